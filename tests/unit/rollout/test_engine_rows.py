"""The engine's ``attention: rows`` layout (a KV cache per row, the prompt copied to each of its group's rows): the
same log-probs as a full forward pass, the same tokens as ``groups`` from the same seed, finished rows leaving the
batch one by one, and ``groups`` kept inside ``keep_caches``."""

from __future__ import annotations

import pytest
import torch

from rlflow.rollout import serving
from rlflow.rollout.base import SamplingParams
from rlflow.rollout.decode_state import DecodeState
from rlflow.rollout.engine import EngineRollout
from tests.helpers.tiny_archs import IdTokenizer, tiny_causal_lm
from tests.unit.rollout.test_engine import assert_logprobs_match_a_full_forward, engine, model, prompts_of  # noqa: F401


def recorded_states(monkeypatch) -> list[DecodeState]:
    """The decode states the serve calls make from now on."""
    made = []
    real = DecodeState.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(DecodeState, "__init__", init)
    return made


@pytest.mark.parametrize("fused", [True, False])
def test_rows_give_a_full_forwards_logprobs(model, tokenizer, fused, monkeypatch):  # noqa: F811
    """Prompts of different lengths joining mid-run (per-row lengths), the generated-token caches growing twice."""
    states = recorded_states(monkeypatch)
    prompts = prompts_of([5, 30, 12], seed=1)
    e = engine(model, tokenizer, max_batch_size=4, prefill_batch_size=1, fused=fused, attention="rows")
    states.clear()  # bind's probe decode
    groups = e.generate(prompts, SamplingParams(0.8, 0.9, 20, max_tokens=70), n=2)
    assert [len(g) for g in groups] == [2, 2, 2]
    assert states and all(s.n == 1 for s in states)  # every row in a group of its own
    assert_logprobs_match_a_full_forward(model, prompts, groups, temperature=0.8)


def test_rows_sample_what_groups_sample(model, tokenizer):  # noqa: F811
    """Each row's draws are its own: the layout changes its arithmetic by rounding only (float32: the same tokens)."""
    prompts = prompts_of([6, 11, 3, 9], seed=4)
    params = SamplingParams(1.0, max_tokens=24, stop_token_ids=[7, 9])
    runs = {}
    for attention in ("groups", "rows"):
        runs[attention] = engine(model, tokenizer, seed=3, max_batch_size=8, attention=attention).generate(
            prompts, params, n=4)
    for got, want in zip(runs["rows"], runs["groups"]):
        assert [c.token_ids for c in got] == [c.token_ids for c in want]
        assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
        for g, w in zip(got, want):
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=2e-5, rtol=0)


def test_finished_rows_leave_one_by_one(model, tokenizer, monkeypatch):  # noqa: F811
    """With ``groups`` a group's finished rows stay until all of its rows are done; with ``rows`` they go alone."""
    kept = []
    real = DecodeState.keep_rows

    def keep_rows(self, keep):
        kept.append((self.n, keep.tolist()))
        return real(self, keep)

    monkeypatch.setattr(DecodeState, "keep_rows", keep_rows)
    prompts = prompts_of([6, 11], seed=4)
    params = SamplingParams(1.0, max_tokens=40, stop_token_ids=list(range(4, 40)))  # rows stop at spread steps
    engine(model, tokenizer, seed=3, attention="rows", split_stragglers=False).generate(prompts, params, n=4)
    assert kept and all(n == 1 for n, _ in kept)
    assert any(len(keep) % 4 for _, keep in kept)  # a compaction that kept a number of rows no group size gives


def test_keep_caches_keeps_groups(monkeypatch):
    """Kept caches are handed back by whole groups (``row_caches``): inside ``keep_caches`` the layout is groups."""
    e = EngineRollout(seed=0, attention="rows")
    e.bind(tiny_causal_lm("qwen3", seed=1), IdTokenizer())
    sizes = []
    real = serving.ServeCall._admit_chunk

    def admit_chunk(self, key, chunk):
        lane, finished = real(self, key, chunk)
        sizes.append(lane.state.n)
        return lane, finished

    monkeypatch.setattr(serving.ServeCall, "_admit_chunk", admit_chunk)
    with e.keep_caches():
        e.generate(prompts_of([5, 8], seed=2), SamplingParams(1.0, max_tokens=5), n=3)
    assert sizes == [3]
    sizes.clear()
    e.generate(prompts_of([5, 8], seed=2), SamplingParams(1.0, max_tokens=5), n=3)
    assert sizes == [1]


def test_an_unknown_layout_is_refused():
    with pytest.raises(ValueError, match="engine attention must be one of groups, rows; got 'cols'"):
        EngineRollout(attention="cols")


def test_rows_in_bf16_go_through_the_fused_attention_with_one_mask_per_row(model, tokenizer, monkeypatch):  # noqa: F811
    """bf16 caches: one SDPA call per layer with the row's mask broadcast over its heads and queries; the log-probs
    agree with ``groups``' to bf16 rounding on the tokens both sampled alike."""
    masks = []
    real = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q, k, v, attn_mask=None, **kwargs):
        masks.append(None if attn_mask is None else tuple(attn_mask.shape))
        return real(q, k, v, attn_mask=attn_mask, **kwargs)

    prompts = prompts_of([6, 11, 3], seed=4)
    params = SamplingParams(1.0, max_tokens=12)
    runs = {}
    for attention in ("groups", "rows"):
        e = engine(model, tokenizer, seed=3, dtype="bfloat16", attention=attention)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
        masks.clear()
        runs[attention] = e.generate(prompts, params, n=4)
        monkeypatch.undo()
        decode = [m for m in masks if m is not None and m[2] in (1, 4 * 2)]  # decode calls (prefills mask [b, 1, w, w])
        assert decode
        if attention == "rows":
            assert all(m[1:3] == (1, 1) for m in decode)  # [rows, 1, 1, width]: broadcast, not copied per query
    compared = 0
    for got, want in zip(runs["rows"], runs["groups"]):
        for g, w in zip(got, want):
            same = next((i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b), len(g.token_ids))
            torch.testing.assert_close(torch.tensor(g.logprobs[:same]), torch.tensor(w.logprobs[:same]), atol=0.05,
                                       rtol=0)
            compared += same
    assert compared > 50
