"""Packed attention in memory linear in the pack (rlflow.training.pack_attention): exact against sequences run
alone, with and without gradient checkpointing, for plain and shared-prompt packs, and no ``tokens x tokens``
tensor anywhere in a packed training step."""

from __future__ import annotations

import contextlib
import functools
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

import rlflow.training.pack_attention as pack_attention
import rlflow.training.packing as packing
from rlflow.data.experience import Experience
from rlflow.models.loading import enable_activation_checkpointing
from rlflow.training.pack_attention import varlen_kernel, varlen_sdpa_attention
from rlflow.training.packing import collate_packed, packed_completion_logprobs
from tests.unit.training.test_packing import assert_grads_equal, reference_grads


def long_model(seed: int = 0, checkpointing: bool = False) -> torch.nn.Module:
    """A 2-layer Qwen3 with grouped-query attention (4 heads, 2 key/value heads) and positions up to 4096."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model("qwen3", vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  max_position_embeddings=4096)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config)
    if checkpointing:
        enable_activation_checkpointing(model)
    return model.train()  # checkpointed layers recompute only in training mode (no dropout in this model)


def groups(seed: int, count: int, prompt: tuple[int, int], completion: tuple[int, int], members: int = 2):
    """``count`` prompts of ``members`` completions each, lengths drawn from the ranges, as experiences."""
    rng = random.Random(seed)
    exps = []
    for g in range(count):
        ids = [rng.randrange(4, 128) for _ in range(rng.randint(*prompt))]
        for _ in range(members):
            c = [rng.randrange(4, 128) for _ in range(rng.randint(*completion))]
            exps.append(Experience(ids, c, [0.0] * len(c), 0.0, 0.0, g, "stop", 0))
    return exps


def alone(model, exps: list[Experience], temperature: float) -> list[torch.Tensor]:
    """The independent reference: each sequence through the model's own forward by itself (no packing, no
    padding, no rlflow attention), log_softmax(logits / T) at each completion token."""
    device = next(model.parameters()).device
    out = []
    for e in exps:
        logits = model(torch.tensor([e.prompt_ids + e.completion_ids], device=device)).logits[0]
        logp = torch.log_softmax(logits[len(e.prompt_ids) - 1: -1].float() / temperature, dim=-1)
        out.append(logp.gather(1, torch.tensor(e.completion_ids, device=device)[:, None])[:, 0])
    return out


@contextlib.contextmanager
def short_long_rows():
    """Rows of more than 8 keys attended one by one, 5 queries per call behind a prefix, and padded sets split
    from 64 mask entries: the long-row paths on sequences short enough for a quick test."""
    saved = pack_attention.LONG_ROW, pack_attention.QUERY_CHUNK, pack_attention.MASK_SPLIT
    pack_attention.LONG_ROW, pack_attention.QUERY_CHUNK, pack_attention.MASK_SPLIT = 8, 5, 64
    try:
        yield
    finally:
        pack_attention.LONG_ROW, pack_attention.QUERY_CHUNK, pack_attention.MASK_SPLIT = saved


REGIMES = {
    # sequences of 200-650 tokens: rows past LONG_ROW (256) at the real sizes, query chunks behind a prefix
    "long": (dict(count=3, prompt=(120, 250), completion=(80, 400)), contextlib.nullcontext),
    # a mix of 4-26 token sequences with the thresholds lowered: short sets, split sets and long rows in one pack
    "mixed": (dict(count=5, prompt=(3, 14), completion=(1, 12), members=3), short_long_rows),
}


@functools.cache
def reference_of(regime: str, share: bool):
    """A regime's experiences, their log-probs each alone (:func:`alone`, temperature 0.9) and the gradients of
    their sum (computed once for the runs with and without checkpointing)."""
    exps = groups(seed=len(regime) + share, **REGIMES[regime][0])
    reference = long_model()
    refs = alone(reference, exps, 0.9)
    return exps, [r.detach() for r in refs], reference_grads(reference, refs)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("share", [False, True], ids=["own-prompts", "shared-prompts"])
@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_packed_logprobs_and_gradients_equal_each_sequence_alone(regime, share, checkpointing):
    """The independent reference is each sequence through the model's own forward, alone (no packing, no rlflow
    attention); the packed batch must give its log-probs and the gradients of their sum."""
    sizes, thresholds = REGIMES[regime]
    exps, refs, ref_grads = reference_of(regime, share)
    model = long_model(checkpointing=checkpointing)
    layers = packing._checkpointed_layers(model)
    assert bool(layers) == checkpointing
    functions = [layer._gradient_checkpointing_func for layer in layers]
    with thresholds():
        batch = collate_packed(exps, share_prompts=share)
        assert (batch["attn_rows"][:, 0] > 0).any() == share  # rows behind a shared prompt
        logprobs, _ = packed_completion_logprobs(model, batch, temperature=0.9, chunk_size=64)
        logprobs[batch["completion_mask"]].sum().backward()  # the checkpointed layers recompute here
    for row, e, want in zip(logprobs, exps, refs):
        torch.testing.assert_close(row[: len(e.completion_ids)], want, atol=2e-5, rtol=0)
    assert_grads_equal(model, ref_grads)
    assert [layer._gradient_checkpointing_func for layer in layers] == functions  # restored after the forward
    assert model.config._attn_implementation == "sdpa"


def dense_attention(q, k, v, batch, scale):
    """Each attention row by the definition: float64 softmax over its keys, masked to the bottom-right causal
    triangle, written to its query positions. ``q`` ``[heads, tokens, dim]``, ``k``/``v`` ``[kv heads, ...]``."""
    groups_of = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups_of, 0), v.repeat_interleave(groups_of, 0)
    out = torch.zeros_like(q)
    flat, start = batch["attn_keys"].tolist(), 0
    for first, n, _ in batch["attn_rows"].tolist():
        keys = torch.tensor(flat[start: start + n])
        start += n
        scores = (q[:, keys[first:]] @ k[:, keys].transpose(1, 2)) * scale
        visible = torch.arange(n)[None, :] <= torch.arange(first, n)[:, None]
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[:, keys[first:]] = weights @ v[:, keys]
    return out


@pytest.mark.parametrize("share", [False, True], ids=["own-prompts", "shared-prompts"])
def test_attention_and_its_gradients_match_the_definition_row_by_row(share):
    """The attention function alone on random states: every plan (short sets, split sets, long rows with and
    without a prefix, query chunks) against :func:`dense_attention` in float64, values and gradients."""
    exps = groups(seed=7, count=4, prompt=(2, 12), completion=(1, 14), members=4)
    with short_long_rows():
        batch = collate_packed(exps, share_prompts=share)
        tokens = batch["input_ids"].shape[1]
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, h, tokens, 8, generator=gen, dtype=torch.float64, requires_grad=True)
                   for h in (4, 2, 2))
        layout = {name: t for name, t in batch.items() if name.startswith("attn")}
        module = torch.nn.Module().eval()
        out, _ = varlen_sdpa_attention(module, q, k, v, None, scaling=0.3, rlflow_pack=layout)
        assert {"plan:sets:cpu"} <= set(layout) and len(layout["plan:sets:cpu"]["long"]) > 0
    want = dense_attention(q[0], k[0], v[0], batch, 0.3)
    torch.testing.assert_close(out[0].transpose(0, 1), want)
    weights = torch.randn(want.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out[0].transpose(0, 1) * weights).sum(), (q, k, v))
    want_grads = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("mode", ["bf16-states", "bf16-autocast"])
def test_a_sixteen_bit_cpu_set_is_attended_in_float32_and_rounded_once(mode, monkeypatch):
    """A padded set that would run torch's 16-bit CPU kernel (16-bit states, or float32 states under bf16 autocast,
    which casts them) runs in float32: each call's states are float32, and the output is the float64 definition
    rounded to bf16 once (within float32's error, far inside bf16's)."""
    exps = groups(seed=3, count=3, prompt=(2, 10), completion=(1, 9), members=3)
    batch = collate_packed(exps, share_prompts=True)
    tokens = batch["input_ids"].shape[1]
    gen = torch.Generator().manual_seed(1)
    exact = [torch.randn(1, h, tokens, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2)]
    states = [t.to(torch.bfloat16) for t in exact]  # the values the call sees, exactly representable in bf16
    if mode == "bf16-autocast":
        states = [t.float() for t in states]
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        calls.append((q.dtype, k.dtype, v.dtype))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    layout = {name: t for name, t in batch.items() if name.startswith("attn")}
    context = torch.autocast("cpu", dtype=torch.bfloat16) if mode == "bf16-autocast" else contextlib.nullcontext()
    with context:
        out, _ = varlen_sdpa_attention(torch.nn.Module().eval(), *states, None, scaling=0.3, rlflow_pack=layout)
    assert calls and all(c == (torch.float32,) * 3 for c in calls)
    assert out.dtype == torch.bfloat16
    want = dense_attention(*(t.double()[0] for t in states), batch, 0.3).transpose(0, 1)[None]
    torch.testing.assert_close(out.double(), want, rtol=2 ** -8, atol=1e-6)  # bf16's rounding: 2 ** -9 relative


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operator returns (forward, backward and recomputation alike)."""

    def __init__(self):
        super().__init__()
        self.numel, self.op, self.ops = 0, None, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.add(str(func.overloadpacket))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.op = t.numel(), str(func)
        return out


def largest_tensor_of_a_step(model, batch) -> LargestTensor:
    """The largest tensor of one packed forward + backward of ``model`` on ``batch``."""
    with LargestTensor() as largest:
        logprobs, entropy = packed_completion_logprobs(model, batch, chunk_size=256)
        (logprobs.sum() + entropy.sum()).backward()
    return largest


@pytest.mark.parametrize("share", [False, True], ids=["own-prompts", "shared-prompts"])
def test_no_tensor_of_a_packed_step_grows_with_the_square_of_the_pack(share, monkeypatch):
    """A pack of 2,185 tokens (four sequences of 504-618 tokens; 1,502 with the prompts shared) through a
    checkpointed training step: no operator returns a tensor of an eighth of ``tokens x tokens`` entries. The
    model's own packed path for the same plain pack does (its block-diagonal mask), which shows the recorder sees
    such a tensor when there is one."""
    exps = groups(seed=3, count=2, prompt=(250, 450), completion=(90, 600), members=2)
    batch = collate_packed(exps, share_prompts=share)
    tokens = batch["input_ids"].shape[1]
    model = long_model(checkpointing=True)
    largest = largest_tensor_of_a_step(model, batch)
    assert "aten._scaled_dot_product_flash_attention_for_cpu_backward" in largest.ops  # the backward was recorded
    assert largest.numel < tokens * tokens / 8, (largest.numel, largest.op, tokens)
    if not share:  # the dense-mask path of transformers, for the same plain pack
        monkeypatch.setattr(packing, "_varlen_attention", lambda model, batch: contextlib.nullcontext({}))
        assert largest_tensor_of_a_step(long_model(checkpointing=True), batch).numel >= tokens * tokens


def test_the_plan_is_built_once_per_forward_and_the_recomputation_reuses_it(monkeypatch):
    """Layers and the checkpointed recomputation share one plan per pack (not one per layer call)."""
    built = []
    original = pack_attention._sets_plan
    monkeypatch.setattr(pack_attention, "_sets_plan", lambda *a: built.append(1) or original(*a))
    batch = collate_packed(groups(seed=1, count=2, prompt=(5, 9), completion=(2, 6)), share_prompts=True)
    logprobs, _ = packed_completion_logprobs(long_model(checkpointing=True), batch)
    logprobs.sum().backward()
    assert built == [1]


def test_the_attention_refuses_to_run_outside_a_packed_forward():
    q = torch.zeros(1, 4, 3, 8)
    with pytest.raises(ValueError, match="runs only in a packed forward"):
        varlen_sdpa_attention(torch.nn.Module(), q, q, q, None)


def test_flash_attention_models_keep_their_own_path_and_refuse_shared_prompts():
    model = long_model()
    model.config._attn_implementation = "flash_attention_2"  # set, not loaded: the forward is never run
    try:
        assert not packing.varlen_supported(model)
        batch = collate_packed(groups(seed=2, count=2, prompt=(5, 9), completion=(2, 6)), share_prompts=True)
        with pytest.raises(ValueError, match="shared prompts needs rlflow's packed attention"):
            with packing._varlen_attention(model, batch):
                pass
        with packing._varlen_attention(model, collate_packed(groups(2, 2, (5, 9), (2, 6)))) as extra:
            assert extra == {}
    finally:
        model.config._attn_implementation = "sdpa"


def test_no_varlen_kernel_off_cuda():
    assert varlen_kernel(torch.zeros(1, 4, 3, 8, dtype=torch.bfloat16)) is None


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("share", [False, True], ids=["own-prompts", "shared-prompts"])
def test_the_varlen_kernel_matches_the_padded_plan_on_cuda(share):
    """On CUDA in bf16 a pack runs one variable-length flash call (flash-attn or torch's own); its outputs and
    gradients match the padded plan's (float32, same states) to bf16 rounding, rows behind a prefix included."""
    exps = groups(seed=5, count=3, prompt=(20, 300), completion=(10, 400), members=3)
    batch = {name: t.cuda() for name, t in collate_packed(exps, share_prompts=share).items()}
    tokens = batch["input_ids"].shape[1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    states = [torch.randn(1, h, tokens, 64, generator=gen, device="cuda") for h in (8, 2, 2)]
    module = torch.nn.Module().eval()
    assert varlen_kernel(states[0].bfloat16()) in ("flash_attn", "torch")
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (s.to(dtype).requires_grad_() for s in states)
        layout = {name: t for name, t in batch.items() if name.startswith("attn")}
        out, _ = varlen_sdpa_attention(module, q, k, v, None, scaling=0.125, rlflow_pack=layout)
        assert ("plan:varlen:cuda:0" in layout) == (dtype == torch.bfloat16)
        out.float().square().sum().backward()
        results.append([out.float(), *(t.grad.float() for t in (q, k, v))])
    for got, want in zip(*results):
        assert (got - want).abs().max() <= 0.02 * want.abs().max() + 1e-3


@pytest.mark.gpu
@cuda
def test_packed_logprobs_under_checkpointing_match_each_sequence_alone_on_cuda():
    """A checkpointed bf16-autocast training step on CUDA: packed log-probs within bf16 rounding of each sequence
    alone, and the gradients pointing the same way."""
    exps = groups(seed=6, count=3, prompt=(50, 300), completion=(50, 500), members=2)
    reference = long_model().cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        refs = alone(reference, exps, 1.0)
        ref_grads = reference_grads(reference, refs)
        model = long_model(checkpointing=True).cuda()
        batch = {name: t.cuda() for name, t in collate_packed(exps, share_prompts=True).items()}
        logprobs, _ = packed_completion_logprobs(model, batch)
        logprobs[batch["completion_mask"]].sum().backward()
    for row, e, want in zip(logprobs, exps, refs):
        assert (row[: len(e.completion_ids)].float() - want.float()).abs().max() <= 0.1
    got = torch.cat([p.grad.flatten() for n, p in model.named_parameters() if n in ref_grads])
    want = torch.cat([ref_grads[n].flatten() for n, p in model.named_parameters() if n in ref_grads])
    assert torch.nn.functional.cosine_similarity(got.float(), want.float(), dim=0) > 0.99


def _causal_per_sequence(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), **gqa):
    """A CPU stand-in of torch's varlen_attn: each sequence attended alone by sdpa, causal at the bottom right."""
    outs = []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t, a, b in ((q, cu_q[i], cu_q[i + 1]), (k, cu_k[i], cu_k[i + 1]),
                                                             (v, cu_k[i], cu_k[i + 1])))
        mask = torch.ones(qs.shape[1], ks.shape[1], dtype=torch.bool).tril(ks.shape[1] - qs.shape[1])
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=scale, **gqa).transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("has_gqa", [False, True], ids=["torch-2.11-signature", "enable_gqa"])
def test_torch_varlen_gets_grouped_query_heads_either_way(monkeypatch, has_gqa):
    """torch's varlen_attn has no enable_gqa before 2.12: with fewer key/value heads than query heads they are
    repeated (query head h reads key/value head h // group); where it has one it gets the heads as they are.
    Either way the output is sdpa's grouped-query attention of each sequence."""
    seen = {}

    def old(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        seen["kv_heads"] = k.shape[1]
        return _causal_per_sequence(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale)

    def new(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
        seen["kv_heads"] = k.shape[1]
        return _causal_per_sequence(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, enable_gqa=enable_gqa)

    monkeypatch.setattr(pack_attention, "_torch_varlen", lambda: new if has_gqa else old)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(11, h, 8, generator=gen) for h in (6, 2, 2))
    cu_q, cu_k = torch.tensor([0, 4, 11]), torch.tensor([0, 4, 11])
    got = pack_attention._call_torch_varlen((q, k, v, cu_q, cu_k, 7, 7), 0.3, True)
    assert seen["kv_heads"] == (2 if has_gqa else 6)
    want = _causal_per_sequence(q, k, v, cu_q, cu_k, 7, 7, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(got, want)
    wrong_grouping = _causal_per_sequence(q, k.repeat(1, 3, 1), v.repeat(1, 3, 1), cu_q, cu_k, 7, 7, scale=0.3)
    assert not torch.allclose(got, wrong_grouping)
