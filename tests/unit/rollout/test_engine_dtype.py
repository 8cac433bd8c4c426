"""The engine's ``dtype`` option: decoding through a bfloat16 copy of float32 master weights.

What is checked: the copies are exactly the bf16 casts of the live weights, refreshed after an optimizer step
(and reused while the weights are unchanged; switching LoRA adapters off counts as a change); the bf16 engine's
log-probs agree with the model's own bf16 forward to within bf16 rounding, a bound measured in the test itself
(how far the model's bf16 forward lies from its float32 forward on the same tokens), in one-turn rollouts and in
multi-turn continuations on kept bf16 caches; the float32 paths stay exact; ``auto`` (bf16 where the device
multiplies it, else float32 copies on a CPU) and bad values; the 16-bit matrices' layout where nothing packs them.
The ``norm`` option: ``F.rms_norm`` against a float64 formula rounded once, where each decoder path uses it, and
bf16 rollouts with it within the same measured bound.
"""

from __future__ import annotations

import copy

import pytest
import torch

from rlflow.rollout import engine as engine_module
from rlflow.rollout import fused
from rlflow.rollout.base import SamplingParams
from rlflow.rollout.engine import EngineRollout, decode_dtype
from tests.helpers.tiny_archs import IdTokenizer, tiny_causal_lm
from tests.unit.rollout.test_engine import assert_logprobs_match_a_full_forward, prompts_of


def bound_engine(model, **kwargs) -> EngineRollout:
    engine = EngineRollout(seed=0, **kwargs)
    engine.bind(model, IdTokenizer())
    return engine


@torch.no_grad()
def completion_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax of one plain forward of ``model`` over prompt + completion, at the completion's tokens."""
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def qkv_of(model, layer: int) -> torch.Tensor:
    attn = model.model.layers[layer].self_attn
    return torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_the_decoder_holds_exact_bf16_casts_of_the_live_weights(name):
    model = tiny_causal_lm(name)
    engine = bound_engine(model, dtype="bfloat16")
    engine.generate(prompts_of([9, 12]), SamplingParams(1.0, max_tokens=4), n=2)
    decoder = engine._kept_decoder[1]
    layer = decoder.layers[1]
    assert layer.qkv_w.dtype == torch.bfloat16 and decoder.lm_head_w.dtype == torch.bfloat16
    assert torch.equal(layer.qkv_w.t(), qkv_of(model, 1).to(torch.bfloat16))  # no fold: the plain cast
    mlp = model.model.layers[1].mlp
    assert torch.equal(layer.down_w.t(), mlp.down_proj.weight.to(torch.bfloat16))
    assert torch.equal(decoder.lm_head_w.t(), model.lm_head.weight.to(torch.bfloat16))
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the master weights are untouched


@pytest.mark.parametrize("name,source,norm", [("llama", "copies", "auto"), ("qwen3", "copies", "auto"),
                                              ("qwen3", "bf16 model", "auto"), ("llama", "copies", "torch"),
                                              ("qwen3", "copies", "torch"), ("qwen3", "bf16 model", "torch")])
def test_bf16_engine_logprobs_agree_with_a_bf16_forward_to_bf16_rounding(name, source, norm):
    """bf16 arithmetic of one function in two orders of operations differs by rounding, not by a fixed amount, so
    the bound is measured here: the model's own bf16 forward against its float32 forward on the same tokens.
    The engine's bf16 log-probs (bf16 copies of float32 weights, or a model loaded in bf16: both decode with bf16
    caches and SDPA attention) must lie as close to the bf16 forward as that (a factor 2 for the engine's other
    order of operations), and must differ from the float32 ones (it really decoded in bf16). With ``norm:
    torch`` (``F.rms_norm``, which rounds once where the model rounds twice) the same bound holds; ``auto`` keeps
    the model's formula on a CPU."""
    model = tiny_causal_lm(name, seed=1)
    half = copy.deepcopy(model).to(torch.bfloat16)
    prompts = prompts_of([11, 17, 8], seed=2)
    engine = bound_engine(model, dtype="bfloat16", norm=norm) if source == "copies" else bound_engine(half, norm=norm)
    groups = engine.generate(prompts, SamplingParams(1.0, max_tokens=12), n=3)
    assert engine._kept_decoder[1].rms_norm is (fused._torch_rms_norm if norm == "torch" else fused._rms_norm)
    engine_vs_half, float_vs_half, engine_vs_float = [], [], []
    for prompt, group in zip(prompts, groups):
        for c in group:
            got = torch.tensor(c.logprobs, dtype=torch.float64)
            fp32, bf16 = completion_logprobs(model, prompt, c.token_ids), completion_logprobs(half, prompt, c.token_ids)
            engine_vs_half.append((got - bf16).abs())
            float_vs_half.append((fp32 - bf16).abs())
            engine_vs_float.append((got - fp32).abs())
    engine_vs_half, float_vs_half, engine_vs_float = map(torch.cat, (engine_vs_half, float_vs_half, engine_vs_float))
    assert float_vs_half.max() > 0  # bf16 rounding is visible on this model
    assert engine_vs_half.max() <= 2 * float_vs_half.max() + 1e-6
    assert engine_vs_half.mean() <= 2 * float_vs_half.mean() + 1e-6
    assert engine_vs_float.max() > 1e-5  # not the float32 path


@pytest.mark.parametrize("dtype", ["model", "float32"])
def test_the_float32_paths_stay_exact(model, tokenizer, dtype):
    prompts = prompts_of([10, 14, 6], seed=4)
    engine = EngineRollout(seed=3, dtype=dtype)
    engine.bind(model, tokenizer)
    groups = engine.generate(prompts, SamplingParams(0.8, max_tokens=10), n=3)
    assert engine._kept_decoder[1].dtype == torch.float32
    assert_logprobs_match_a_full_forward(model, prompts, groups, 0.8)


@pytest.mark.parametrize("sync", [True, False])
def test_the_copies_follow_an_optimizer_step_and_are_reused_while_the_weights_stay(sync):
    """After an optimizer step the next rollout decodes with the new weights' casts, whether or not the trainer
    called sync_weights (the in-place update moves the parameters' version counters); without a change the
    copies of the last call are reused."""
    model = tiny_causal_lm("llama", seed=5)
    engine = bound_engine(model, dtype="bfloat16")
    prompts, params = prompts_of([9, 13], seed=6), SamplingParams(1.0, max_tokens=6)
    engine.generate(prompts, params, n=2)
    first = engine._kept_decoder[1]
    engine.generate(prompts, params, n=2)
    assert engine._kept_decoder[1] is first  # unchanged weights: no new copies
    before = qkv_of(model, 0).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    model(torch.tensor([prompts[0]]), labels=torch.tensor([prompts[0]])).loss.backward()
    optimizer.step()
    if sync:
        engine.sync_weights()
    groups = engine.generate(prompts, params, n=2)
    decoder = engine._kept_decoder[1]
    assert decoder is not first
    after = qkv_of(model, 0).to(torch.bfloat16)
    assert not torch.equal(after, before)  # the step moved the weights by more than bf16 rounding
    assert torch.equal(decoder.layers[0].qkv_w.t(), after)
    # and the sampled log-probs are those of the new weights (here within 2e-3), not the old ones (0.07-0.18 away)
    half = copy.deepcopy(model).eval().to(torch.bfloat16)
    for prompt, group in zip(prompts, groups):
        for c in group:
            new = completion_logprobs(half, prompt, c.token_ids)
            torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), new, atol=0.01, rtol=0)


@pytest.mark.parametrize("native", [True, False])
def test_auto_is_bf16_where_the_device_multiplies_it_else_float32_on_a_cpu(native, monkeypatch):
    """``auto``: bf16 on a CPU or GPU with bf16 units; float32 copies on a CPU that emulates 16-bit products (a
    16-bit policy there decodes through float32 copies; a float32 policy through its own weights, as ``model``);
    the model's own dtype on a GPU without bf16."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(engine_module, "bf16_faster", lambda device: native)
    assert decode_dtype("auto", cpu) == (torch.bfloat16 if native else torch.float32)
    assert decode_dtype("auto", cuda) == (torch.bfloat16 if native else None)
    assert decode_dtype("model", cpu) is None and decode_dtype("bfloat16", cpu) == torch.bfloat16


def test_the_float32_decoder_of_a_float32_model_is_its_own_under_auto(model, tokenizer, monkeypatch):
    """On a CPU without bf16 units ``auto`` decodes a float32 model exactly as ``model`` does: its own weights,
    folded, the same tokens and log-probs."""
    monkeypatch.setattr(engine_module, "bf16_faster", lambda device: False)
    prompts, params = prompts_of([10, 14], seed=8), SamplingParams(0.9, max_tokens=8)
    runs = {}
    for dtype in ("auto", "model"):
        engine = EngineRollout(seed=5, dtype=dtype)
        engine.bind(model, tokenizer)
        runs[dtype] = engine.generate(prompts, params, n=3)
        decoder = engine._kept_decoder[1]
        assert decoder.dtype == torch.float32 and decoder.cast is None and decoder.fold
    assert [[c.token_ids for c in g] for g in runs["auto"]] == [[c.token_ids for c in g] for g in runs["model"]]
    assert [[c.logprobs for c in g] for g in runs["auto"]] == [[c.logprobs for c in g] for g in runs["model"]]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_auto_decodes_a_bf16_policy_through_float32_copies_on_a_cpu_without_bf16_units(name, monkeypatch):
    """A policy loaded in bf16 on such a CPU decodes with float32 copies of its bf16 weights: its log-probs are
    those of the same weights in float32 (a plain forward of ``model.float()``, to float32 rounding), not those of
    the bf16 forward (which lie further from them than bf16 rounding of the logits)."""
    monkeypatch.setattr(engine_module, "bf16_faster", lambda device: False)
    half = tiny_causal_lm(name, seed=7).to(torch.bfloat16)
    engine = bound_engine(half, dtype="auto")
    prompts = prompts_of([9, 15, 11], seed=9)
    groups = engine.generate(prompts, SamplingParams(1.0, max_tokens=10), n=3)
    decoder = engine._kept_decoder[1]
    assert decoder.dtype == torch.float32 and decoder.layers[0].qkv_w.dtype == torch.float32
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())  # the policy itself is untouched
    assert_logprobs_match_a_full_forward(copy.deepcopy(half).float(), prompts, groups, 1.0, atol=1e-4)
    got = torch.cat([torch.tensor(c.logprobs, dtype=torch.float64) for g in groups for c in g])
    bf16 = torch.cat([completion_logprobs(half, p, c.token_ids) for p, g in zip(prompts, groups) for c in g])
    assert (got - bf16).abs().max() > 1e-3  # not the bf16 arithmetic


@pytest.mark.parametrize("packs", [True, False])
def test_16_bit_matrices_take_nn_linears_layout_where_nothing_packs_them(packs, monkeypatch):
    """On a CPU that does not pack 16-bit matrices (no AMX or AVX512-BF16), ``torch.mm`` of a contiguous
    ``[in, out]`` 16-bit matrix takes a kernel path many times slower than of the transposed view of ``[out, in]``
    (``nn.Linear``'s layout): there every 16-bit matrix of the decoder, the LM head included, is that view, both for
    a bf16 model and for bf16 copies of a float32 one. Where the CPU packs them the LM head is a contiguous copy
    (packed per row count at the first decode step)."""
    monkeypatch.setattr(fused, "packs", lambda dtype: packs)
    model = tiny_causal_lm("qwen3", seed=3)
    for decoder in (fused.FusedDecoder(copy.deepcopy(model).to(torch.bfloat16)),
                    fused.FusedDecoder(model, torch.bfloat16)):
        layer = decoder.layers[0]
        assert decoder.lm_head_w.is_contiguous() == packs
        assert decoder.lm_head_w.t().is_contiguous() != packs
        for name in ("qkv_w", "o_w", "gate_up_w", "down_w"):
            weight = getattr(layer, name)
            assert weight.dtype == torch.bfloat16
            assert weight.t().is_contiguous() or packs  # the transposed view (where packed: either, packed later)
        assert torch.equal(decoder.lm_head_w.t(), model.lm_head.weight.to(torch.bfloat16))


def test_bad_values():
    with pytest.raises(ValueError, match="engine dtype must be one of model, float32, bfloat16, float16, auto"):
        EngineRollout(dtype="bf16")


@pytest.mark.parametrize("shape", [(64, 96), (5, 4, 32)])
def test_torch_norm_rounds_once_like_a_float64_formula(shape):
    """``_torch_rms_norm`` in bf16 against weight * x / sqrt(mean(x^2) + eps) computed in float64 and rounded to
    bf16 once: within one bf16 step everywhere and equal almost everywhere (its float32 arithmetic may land on
    the other side of a rounding boundary). The model's formula rounds twice (the normed values, then their
    product with the weight), so it is equal less often. A stacked per-head weight (Qwen3's q/k norms) is applied
    after the norm, as the model does."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16)
    weight = (1 + torch.randn(shape[-1] if len(shape) == 2 else shape[1:], generator=g) / 2).to(torch.bfloat16)
    eps = 1e-6
    x64 = x.double()
    normed64 = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    got = fused._torch_rms_norm(x, weight, eps)
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    if weight.dim() == 1:
        want = (normed64 * weight.double()).to(torch.bfloat16)
        model_way = fused._rms_norm(x, weight, eps)
        same, model_same = (got == want).double().mean(), (model_way == want).double().mean()
        assert same >= 0.99 and same > model_same
    else:  # the model's order: normed rounded to bf16, then the bf16 product with the weight
        want = (weight.double() * normed64.to(torch.bfloat16).double()).to(torch.bfloat16)
        assert (got == want).double().mean() >= 0.99
    step = want.double().abs().clamp_min(1e-30) * 2.0 ** -7  # one bf16 step (8 significant bits)
    assert ((got.double() - want.double()).abs() <= step).all()


def test_the_norm_option_resolves_by_device_and_dtype():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert fused.torch_norm_for("auto", torch.bfloat16, cuda) and fused.torch_norm_for("auto", torch.float16, cuda)
    assert not fused.torch_norm_for("auto", torch.float32, cuda)  # float32 decoding stays exact
    assert not fused.torch_norm_for("auto", torch.bfloat16, cpu)  # a composite on a CPU: slower, no gain
    assert fused.torch_norm_for("torch", torch.float32, cpu) and not fused.torch_norm_for("model", torch.bfloat16, cuda)
    with pytest.raises(ValueError, match="engine norm must be one of auto, model, torch; got 'fused'"):
        EngineRollout(norm="fused")


@pytest.fixture(scope="module")
def model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()


@torch.no_grad()
def test_switching_lora_adapters_off_is_a_weight_change():
    """PEFT's disable_adapter() changes what the LoRA layers apply without touching a parameter: the engine must
    not reuse the adapted copies then."""
    from tests.unit.models.test_lora import forward_logprobs, random_lora

    model = tiny_causal_lm("qwen3")
    base = copy.deepcopy(model)
    wrapper = random_lora(model)
    engine = bound_engine(model)
    prompts, params = [[5, 9, 17, 33, 2], [8, 3, 60]], SamplingParams(1.0, max_tokens=8)
    adapted = engine.generate(prompts, params, n=2)
    with wrapper.disable_adapter():
        plain = engine.generate(prompts, params, n=2)
    for groups, reference in ((adapted, wrapper), (plain, base)):
        for prompt, group in zip(prompts, groups):
            for c in group:
                ids = torch.tensor([prompt + c.token_ids])
                want = forward_logprobs(reference, ids)[0, -len(c.token_ids):]
                torch.testing.assert_close(torch.tensor(c.logprobs), want, rtol=0, atol=1e-4)


def test_multi_turn_continuation_runs_on_bf16_caches(one_thread):
    """keep_caches with bf16 decoding: later turns prefill on the kept bf16 caches; each turn's log-probs lie
    within bf16 rounding of the bf16 model's forward over the whole history (the bound measured as above)."""
    from tests.helpers.multiturn_helpers import qwen3_char_tokenizer, tiny_model
    from tests.unit.rollout.test_engine_continuation import three_turns

    tok = qwen3_char_tokenizer()
    model = tiny_model(len(tok))
    half = copy.deepcopy(model).to(torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, len(tok), (k,), generator=g).tolist() for k in (9, 14)]
    inserts = [[torch.randint(0, len(tok), (3,), generator=g).tolist() for _ in range(4)] for _ in range(2)]
    engine = EngineRollout(seed=3, dtype="bfloat16")
    engine.bind(model, tok)
    turns = three_turns(engine, prompts, SamplingParams(1.0, max_tokens=8), inserts, 2, keep=True)
    assert engine.reused_tokens > 0  # the later turns continued from kept caches
    to_half, float_to_half = [], []
    for turn, (current, outs, _, _) in enumerate(turns):
        for prefix, c in zip([p for p in current for _ in range(2 if turn == 0 else 1)], outs):
            fp32, bf16 = completion_logprobs(model, prefix, c.token_ids), completion_logprobs(half, prefix, c.token_ids)
            to_half.append((torch.tensor(c.logprobs, dtype=torch.float64) - bf16).abs())
            float_to_half.append((fp32 - bf16).abs())
    to_half, float_to_half = torch.cat(to_half), torch.cat(float_to_half)
    assert to_half.max() <= 2 * float_to_half.max() + 1e-6 and to_half.mean() <= 2 * float_to_half.mean() + 1e-6
