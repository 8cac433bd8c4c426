"""rlflow.rollout.graphs: piecewise decode-step graphs give the fused decoder's logits; the engine decodes through
them and falls back to eager steps when a capture fails.

On a CPU the segments run eagerly into the same static buffers a CUDA graph would write (``capture="eager"``);
``tests/integration/test_gpu.py`` checks real captures on CUDA. The segments' freedom from host synchronisation
(which a CUDA capture refuses) is checked here on meta tensors, which cannot be read.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlflow.rollout import engine as engine_module
from rlflow.rollout import graphs
from rlflow.rollout.base import SamplingParams
from rlflow.rollout.engine import EngineRollout
from rlflow.rollout.fused import FusedDecoder
from rlflow.rollout.graphs import BUCKETS, GraphedDecoder, bucket_for
from tests.unit.rollout.test_engine import prompts_of
from tests.unit.rollout.test_fused_decoder import build


def test_buckets_hold_every_row_count_with_at_most_a_third_of_padding():
    for rows in range(1, 2000):
        size = bucket_for(rows, max_rows=4096)
        assert size >= rows and (size - rows) / size <= 1 / 3, rows
        assert all(b < rows for b in BUCKETS if b < size)  # the smallest bucket that holds the rows
    assert bucket_for(257, max_rows=256) is None and bucket_for(256, max_rows=256) == 256


class RecordingAttend:
    """Attention from its definition over a per-layer cache of earlier steps' keys/values (a fixed history per
    row plus what this step writes), recording the row counts it is called with."""

    def __init__(self, decoder: FusedDecoder, rows: int, history: int, seed: int, device: str = "cpu") -> None:
        g = torch.Generator().manual_seed(seed)
        shape = (rows, decoder.num_kv_heads, history, decoder.head_dim)
        self.keys = [torch.randn(shape, generator=g).to(device, decoder.dtype) for _ in decoder.layers]
        self.values = [torch.randn(shape, generator=g).to(device, decoder.dtype) for _ in decoder.layers]
        self.heads = decoder.num_heads
        self.rows_seen: list[int] = []

    def __call__(self, layer: int, q, k, v, scaling):
        self.rows_seen.append(q.shape[0])
        keys = torch.cat([self.keys[layer], k], dim=2).float()
        values = torch.cat([self.values[layer], v], dim=2).float()
        rep = self.heads // keys.shape[1]
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        weights = torch.softmax((q.float() @ keys.transpose(-1, -2)) * scaling, dim=-1)
        return (weights @ values).reshape(q.shape[0], -1).to(q.dtype)


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama", "llama-dynamic-rope"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_graphed_steps_give_the_decoders_logits_padded_or_not(kind, dtype):
    check_graphed_steps(FusedDecoder(build(kind), dtype), "eager", atol=1e-5 if dtype is None else 0.05)


@torch.no_grad()
def check_graphed_steps(decoder: FusedDecoder, capture: str, atol: float, device: str = "cpu") -> None:
    """Steps of 6, 5, 3, 6 and 7 rows through ``capture`` graphs give the decoder's own logits (6 and 3: whole
    buckets; 5 after 6: stale padding rows), within ``atol`` (and ``atol / 2.5`` relative)."""
    graphed = GraphedDecoder(decoder, max_rows=64, capture=capture)
    for step, rows in enumerate([6, 5, 3, 6, 7]):
        tokens = torch.randint(0, 97, (rows,), generator=torch.Generator().manual_seed(step)).to(device)
        positions = torch.randint(8, 40, (rows,), generator=torch.Generator().manual_seed(100 + step)).to(device)
        attend = RecordingAttend(decoder, rows, history=9, seed=step, device=device)
        got = graphed.step(tokens, positions, attend)
        want = decoder.step(tokens, positions, RecordingAttend(decoder, rows, history=9, seed=step, device=device))
        assert got.shape == want.shape == (rows, 97)
        torch.testing.assert_close(got, want, atol=atol, rtol=atol / 2.5)
        assert attend.rows_seen == [rows] * len(decoder.layers)  # attention sees the real rows only
    assert sorted(graphed.buckets) == [3, 6, 8]  # one capture per bucket, reused by later steps


@torch.no_grad()
def test_steps_beyond_the_largest_bucket_run_eagerly():
    decoder = FusedDecoder(build("qwen3"))
    graphed = GraphedDecoder(decoder, max_rows=4, capture="eager")
    tokens, positions = torch.arange(5), torch.full((5,), 9)
    got = graphed.step(tokens, positions, RecordingAttend(decoder, 5, history=9, seed=0))
    want = decoder.step(tokens, positions, RecordingAttend(decoder, 5, history=9, seed=0))
    assert torch.equal(got, want) and not graphed.buckets


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama"])
def test_the_segments_never_read_a_tensors_value_so_a_cuda_capture_can_record_them(kind):
    """A CUDA capture fails on any host synchronisation (``.item()``, ``int(t)``, a data-dependent shape): on meta
    tensors every such read raises, so capturing a bucket over meta buffers proves the segments free of them."""
    with torch.device("meta"):
        decoder = FusedDecoder(build(kind).to("meta"))
        graphed = GraphedDecoder(decoder, max_rows=8, capture="eager")
        cos = sin = torch.empty(8, 1, decoder.head_dim)
        bucket = graphed._bucket(8, torch.empty(8, dtype=torch.long), cos, sin)
    assert len(bucket.segments) == len(decoder.layers) + 1
    assert bucket.segments[-1][1][0].shape == (8, 97) and bucket.segments[-1][1][0].is_meta
    with pytest.raises(RuntimeError, match="meta"):  # the check itself: a read of a value does raise
        int(bucket.segments[0][1][0].sum())


def graphed_engine(model, tokenizer, **kwargs) -> EngineRollout:
    engine = EngineRollout(seed=0, **kwargs)
    engine.bind(model, tokenizer)
    return engine


@pytest.fixture
def eager_graphs(monkeypatch):
    """Graphs on this CPU: the engine captures with ``capture="eager"`` where it would capture CUDA graphs."""
    monkeypatch.setattr(engine_module, "capture_kind", lambda device: "eager")


@pytest.fixture(scope="module")
def model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_engine_decodes_through_graphs_to_the_same_tokens(model, tokenizer, eager_graphs, temperature):
    prompts = prompts_of([5, 30, 12, 9], seed=3)
    params = SamplingParams(temperature, 1.0, 0, max_tokens=24, stop_token_ids=[7])  # rows finish apart
    plain = graphed_engine(model, tokenizer, cuda_graphs=False, max_batch_size=8, prefill_batch_size=2)
    graphed = graphed_engine(model, tokenizer, max_batch_size=8, prefill_batch_size=2)
    want, got = plain.generate(prompts, params, n=3), graphed.generate(prompts, params, n=3)
    assert plain._graphed is None and graphed._graphed is not None and graphed.graphs_error is None
    assert plain.decode_path == "fused decode"
    assert graphed.decode_path == "fused decode, decode steps as CUDA graphs"  # what data.rollout=auto logs
    assert len(graphed._graphed.buckets) >= 2  # rows left and joined: more than one bucket ran
    assert graphed._graphed.capture_seconds > 0
    for w_group, g_group in zip(want, got):
        for w, g in zip(w_group, g_group):
            assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
@torch.no_grad()
def test_a_refreshed_decoder_computes_what_a_new_one_does_bit_for_bit(kind, dtype):
    model = build(kind)
    decoder = FusedDecoder(model, dtype)
    for p in model.parameters():  # an optimizer step: every weight, bias and norm moves, in place
        p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    tokens, positions = torch.arange(4), torch.tensor([9, 10, 11, 30])
    stale = decoder.step(tokens, positions, RecordingAttend(decoder, 4, history=9, seed=0))
    decoder.refresh(model)
    got = decoder.step(tokens, positions, RecordingAttend(decoder, 4, history=9, seed=0))
    want = FusedDecoder(model, dtype).step(tokens, positions, RecordingAttend(decoder, 4, history=9, seed=0))
    assert torch.equal(got, want) and not torch.equal(got, stale)


def test_new_weights_go_into_the_graphed_decoder_and_moved_ones_get_new_graphs(model, tokenizer, eager_graphs):
    model = copy.deepcopy(model)  # the module's model stays as it is
    prompts, params = prompts_of([6, 8], seed=4), SamplingParams(0.0, 1.0, 0, max_tokens=8)
    engine = graphed_engine(model, tokenizer)

    def check(expect_same_graphs: bool) -> None:
        before = engine._graphed
        got = engine.generate(prompts, params, n=2)
        assert (engine._graphed is before) == expect_same_graphs and engine._graphed is not None
        want = graphed_engine(model, tokenizer, cuda_graphs=False).generate(prompts, params, n=2)
        assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in want]
        assert [[c.logprobs for c in g] for g in got] == [[c.logprobs for c in g] for g in want]

    engine.generate(prompts, params, n=2)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(3.0)  # an optimizer step, in place
    engine.sync_weights()
    assert engine._kept_decoder is not None  # kept: the graphs read its copies
    check(expect_same_graphs=True)
    up = model.model.layers[0].mlp.up_proj
    up.weight = torch.nn.Parameter(up.weight.detach() * 0.5)  # a weight at a new address: new copies, new graphs
    check(expect_same_graphs=False)


def test_without_graphs_sync_weights_frees_the_decoders_copies(model, tokenizer):
    engine = graphed_engine(model, tokenizer)
    engine.generate(prompts_of([6, 8], seed=4), SamplingParams(0.0, 1.0, 0, max_tokens=4), n=2)
    assert engine._kept_decoder is not None and engine._graphed is None  # a CPU: no graphs
    engine.sync_weights()
    assert engine._kept_decoder is None


def test_a_failed_capture_is_logged_once_and_the_run_decodes_eagerly(model, tokenizer, eager_graphs, monkeypatch,
                                                                   caplog):
    calls = []

    def refuse(self, bucket):
        calls.append(bucket)
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs.GraphedDecoder, "_segments", refuse)
    prompts, params = prompts_of([6, 11], seed=5), SamplingParams(0.7, 1.0, 0, max_tokens=10)
    engine = graphed_engine(model, tokenizer)
    with caplog.at_level(logging.WARNING):
        got = [engine.generate(prompts, params, n=2) for _ in range(2)]
    warnings = [r.getMessage() for r in caplog.records if "graph capture failed" in r.getMessage()]
    assert len(warnings) == 1 and "operation not permitted" in warnings[0] and len(calls) == 1
    assert engine.graphs_error and "RuntimeError" in engine.graphs_error
    assert "eager decode steps (CUDA graph capture failed: RuntimeError" in engine.decode_path
    plain = graphed_engine(model, tokenizer, cuda_graphs=False)
    want = [plain.generate(prompts, params, n=2) for _ in range(2)]
    assert [[[c.token_ids for c in g] for g in r] for r in got] == [[[c.token_ids for c in g] for g in r] for r in want]


def test_a_prepacked_decoder_is_not_refreshed_in_place():
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlflow.rollout.prepack import PackedWeight, packable

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=512, intermediate_size=512, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=4)).eval()
    decoder = FusedDecoder(model)
    if not packable(decoder.layers[0].gate_up_w):
        pytest.skip("this torch has no packed float32 GEMM (MKL)")
    decoder.prepack(4)
    assert isinstance(decoder.layers[0].gate_up_w, PackedWeight)
    with pytest.raises(ValueError, match="prepacked; build a new decoder"):
        decoder.refresh(model)
