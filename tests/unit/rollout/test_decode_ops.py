"""The compiled operations around a decode step's products (:mod:`rlflow.rollout.decode_ops`): the RMS norm and
SiLU * up against float64 formulas within a few float32 roundings; RoPE bit for bit against torch's formula; the
decode attention against a float64 reference worked out here (masked columns, a per-step mask, a scale, head dims
that take every instance and masked tails, any number of query heads per key/value head), its k/v write, and each
row's bits at any thread count; the :class:`DecodeState` and :class:`LaneStates` paths against torch's; refused
operands; the fused decoder using them where the row GEMM packs a float32 SiLU decoder, and agreeing with its torch
path to rounding on Llama, Qwen2 (biases) and Qwen3 (q/k norms); torch's operators where they do not apply (a
GELU MLP, a bf16 decoder, MKL's products, ``norm: torch``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from rlflow.rollout import decode_ops, prepack, row_gemm
from rlflow.rollout.decode_state import DecodeState, LaneStates
from rlflow.rollout.fused import FusedDecoder

pytestmark = pytest.mark.skipif(not decode_ops.available(),
                                reason=f"the compiled decode operations do not run here: "
                                       f"{row_gemm.unsupported_reason() or 'their build failed (see the log)'}")
U = 2.0 ** -24  # float32's unit roundoff


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("rows, dim", [(1, 576), (16, 576), (5, 37), (300, 64)])
def test_rms_norm_is_the_formula_within_the_float32_summation_bound(rows, dim):
    x = torch.randn(rows, dim, generator=generator(0)) * 3
    x64 = x.double()
    want = x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + 1e-5)
    got = decode_ops.rms_norm(x, 1e-5).double()
    assert got.shape == x.shape
    assert ((got - want).abs() <= (dim + 4) * U * want.abs() + 1e-30).all()


def test_rms_norm_with_one_weight_row_per_head():
    heads, dim = 5, 16
    x = torch.randn(3 * heads, dim, generator=generator(1))
    weight = torch.randn(heads, dim, generator=generator(2))
    plain = decode_ops.rms_norm(x, 1e-6)
    got = decode_ops.rms_norm(x, 1e-6, weight)
    assert torch.equal(got, weight.repeat(3, 1) * plain)  # row i takes weight row i % heads
    assert torch.equal(decode_ops.rms_norm(x, 1e-6, weight[0]), weight[0] * plain)


@pytest.mark.parametrize("rows, heads, dim", [(16, 12, 64), (3, 5, 40), (7, 2, 128)])
def test_rope_gives_torchs_bits(rows, heads, dim):
    qkv = torch.randn(rows, heads * dim + 3 * dim, generator=generator(3))
    table = torch.randn(300, 2, dim, generator=generator(4))
    positions = torch.randint(0, 300, (rows,), generator=generator(5))
    cos, sin = table.index_select(0, positions).unsqueeze(1).unbind(2)
    qk = qkv[:, : heads * dim].view(rows, heads, dim)
    want = torch.addcmul(qk * cos, qk.roll(dim // 2, -1), sin)
    assert torch.equal(decode_ops.rope(qkv, table, positions, heads, dim), want)


def test_rope_refuses_a_position_outside_the_table():
    with pytest.raises(RuntimeError, match="outside the table"):
        decode_ops.rope(torch.randn(2, 64), torch.randn(4, 2, 32), torch.tensor([1, 4]), 2, 32)


@pytest.mark.parametrize("rows, inter", [(16, 1536), (3, 37), (1, 16)])
def test_silu_mul_is_the_formula_to_a_few_roundings(rows, inter):
    gate_up = torch.randn(rows, 2 * inter, generator=generator(6)) * 6
    gate, up = gate_up.double().split(inter, dim=-1)
    want = gate / (1 + torch.exp(-gate)) * up
    got = decode_ops.silu_mul(gate_up, inter).double()
    assert ((got - want).abs() <= 6 * U * want.abs() + 1e-37).all()  # exp (1 ulp), the division, the product


def reference_attention(q, cache_k, cache_v, bias, step_bias, width, n, scale):
    """float64, one query at a time: softmax over the columns of finite mask of scale * q.k + mask, then values."""
    groups, kv_heads = cache_k.shape[:2]
    rows, heads, dim = q.shape
    rep = heads // kv_heads
    out = torch.zeros(rows, heads, dim, dtype=torch.float64)
    for row in range(rows):
        g, s = divmod(row, n)
        mask = bias[g, s, :width].double()
        if step_bias is not None:
            mask = mask + step_bias[g, :width].double()
        for h in range(heads):
            keys, values = cache_k[g, h // rep, :width].double(), cache_v[g, h // rep, :width].double()
            scores = keys @ (q[row, h].double() * scale) + mask
            out[row, h] = torch.softmax(scores, dim=0) @ values
    return out.view(rows, heads * dim)


def attention_case(groups, n, kv_heads, rep, dim, width, seed, per_step=False):
    g = generator(seed)
    columns = width + 8
    cache_k = torch.randn(groups, kv_heads, columns, dim, generator=g)
    cache_v = torch.randn(groups, kv_heads, columns, dim, generator=g)
    q = torch.randn(groups * n, kv_heads * rep, dim, generator=g)
    bias = torch.zeros(groups, n, columns)
    bias[torch.rand(groups, n, columns, generator=g) < 0.4] = float("-inf")  # columns a row does not see
    bias[:, :, 0] = 0.0  # every row sees one column at least
    step_bias = None
    if per_step:
        step_bias = torch.zeros(groups, columns)
        step_bias[:, width - 3:] = float("-inf")
    return q, cache_k, cache_v, bias, step_bias


@pytest.mark.parametrize("dim", [64, 80, 128, 256, 16])
@pytest.mark.parametrize("rep", [1, 3, 5])
def test_attend_is_the_masked_softmax_attention(dim, rep):
    groups, n, kv_heads, width = 3, 4, 2, 45
    q, cache_k, cache_v, bias, _ = attention_case(groups, n, kv_heads, rep, dim, width, seed=dim + rep)
    k, v = torch.randn(groups * n, kv_heads, dim), torch.randn(groups * n, kv_heads, dim)
    want = reference_attention(q, cache_k, cache_v, bias, None, width, n, 1.0)
    got = decode_ops.attend(q, k, v, cache_k, cache_v, -1, bias, None, width, n, 1.0)
    assert torch.allclose(got.double(), want, rtol=0, atol=2e-5)


def test_attend_writes_the_steps_keys_and_values_first_and_applies_the_step_mask_and_scale():
    groups, n, kv_heads, rep, dim, width = 2, 3, 2, 2, 64, 40
    q, cache_k, cache_v, bias, step_bias = attention_case(groups, n, kv_heads, rep, dim, width, seed=9, per_step=True)
    k, v = torch.randn(groups * n, kv_heads, dim), torch.randn(groups * n, kv_heads, dim)
    start, scale = 20, 0.125
    before_k = cache_k.clone()
    got = decode_ops.attend(q, k, v, cache_k, cache_v, start, bias, step_bias, width, n, scale)
    written_k = k.view(groups, n, kv_heads, dim).transpose(1, 2)
    assert torch.equal(cache_k[:, :, start: start + n], written_k)
    assert torch.equal(cache_v[:, :, start: start + n], v.view(groups, n, kv_heads, dim).transpose(1, 2))
    assert torch.equal(cache_k[:, :, :start], before_k[:, :, :start])  # nothing else written
    want = reference_attention(q, cache_k, cache_v, bias, step_bias, width, n, scale)
    assert torch.allclose(got.double(), want, rtol=0, atol=2e-5)


def test_attend_gives_each_row_the_same_bits_at_any_thread_count():
    q, cache_k, cache_v, bias, _ = attention_case(4, 4, 3, 3, 64, 120, seed=11)
    k, v = torch.randn(16, 3, 64), torch.randn(16, 3, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode_ops.attend(q, k, v, cache_k, cache_v, -1, bias, None, 120, 4, 1.0)
        torch.set_num_threads(2)
        two = decode_ops.attend(q, k, v, cache_k, cache_v, -1, bias, None, 120, 4, 1.0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_attend_refuses_operands_it_cannot_read():
    q, cache_k, cache_v, bias, _ = attention_case(2, 2, 1, 2, 16, 10, seed=12)
    k = v = torch.randn(4, 1, 16)
    with pytest.raises(RuntimeError, match="float32"):
        decode_ops.attend(q.double(), k, v, cache_k, cache_v, -1, bias, None, 10, 2, 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        decode_ops.attend(q, k, v, cache_k.transpose(2, 3).contiguous().transpose(2, 3), cache_v, -1, bias, None,
                          10, 2, 1.0)
    with pytest.raises(RuntimeError, match="bias"):
        decode_ops.attend(q, k, v, cache_k, cache_v, -1, bias[:, :1], None, 10, 2, 1.0)
    with pytest.raises(RuntimeError, match="width or start"):
        decode_ops.attend(q, k, v, cache_k, cache_v, 9, bias, None, 10, 2, 1.0)


def decode_state(n, groups, kv_heads, dim, prompt, seed):
    g = generator(seed)
    state = DecodeState(n, max_tokens=40)
    mask = torch.ones(groups, prompt, dtype=torch.long)
    mask[0, :2] = 0  # a left-padded prompt
    keys = [torch.randn(groups, kv_heads, prompt, dim, generator=g)]
    state.add_groups(list(range(groups)), keys, [torch.randn(groups, kv_heads, prompt, dim, generator=g)], mask)
    return state


def step_both(states, rows, heads, kv_heads, dim, seed, steps=5):
    """``steps`` decode steps of the same inputs through the compiled and torch paths of two copies of a state."""
    g = generator(seed)
    for _ in range(steps):
        q = torch.randn(rows, heads, 1, dim, generator=g)
        k, v = torch.randn(rows, kv_heads, 1, dim, generator=g), torch.randn(rows, kv_heads, 1, dim, generator=g)
        outs = []
        for state, compiled in zip(states, (True, False)):
            state.begin_step()
            outs.append(state.write_attend(0, q, k, v, 1 / math.sqrt(dim), compiled=compiled))
            state.end_step()
        assert outs[0].shape == (rows, heads * dim)
        assert torch.allclose(outs[0], outs[1], rtol=0, atol=1e-5)


def test_a_decode_states_compiled_steps_agree_with_its_torch_steps_in_both_modes():
    n, groups, kv_heads, heads, dim = 3, 2, 2, 6, 32
    states = [decode_state(n, groups, kv_heads, dim, 7, seed=13) for _ in range(2)]
    step_both(states, groups * n, heads, kv_heads, dim, seed=14)  # every group fed alike: one write slice
    for state in states:  # a group joins behind: per-group lengths and a per-step mask from now on
        g = generator(15)
        keys, values = [torch.randn(1, kv_heads, 5, dim, generator=g)], [torch.randn(1, kv_heads, 5, dim, generator=g)]
        state.add_groups([2], keys, values, torch.ones(1, 5))
        assert state.fed is None
    step_both(states, 3 * n, heads, kv_heads, dim, seed=17)
    written = states[0].prompt_width + 10 * n  # every slot ten steps wrote (the rest was never written)
    for a, b in ((states[0].k[0], states[1].k[0]), (states[0].v[0], states[1].v[0])):
        assert torch.equal(a[:, :, :written], b[:, :, :written])


def test_lane_states_split_the_compiled_steps_by_lane():
    kv_heads, heads, dim = 1, 2, 16
    lanes = [LaneStates([decode_state(2, 2, kv_heads, dim, 4, seed=18), decode_state(1, 3, kv_heads, dim, 6, seed=19)])
             for _ in range(2)]
    step_both(lanes, 2 * 2 + 3, heads, kv_heads, dim, seed=20)


def decoder_model(model_type: str, act: str = "silu") -> torch.nn.Module:
    torch.manual_seed(0)
    extra = {"head_dim": 32} if model_type == "qwen3" else {}
    config = AutoConfig.for_model(model_type, vocab_size=300, hidden_size=128, intermediate_size=256,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=256, tie_word_embeddings=False, hidden_act=act, **extra)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture
def packs_small_matrices(monkeypatch):
    """The row GEMM packs these small models' matrices as it packs a real model's."""
    monkeypatch.setattr(prepack, "float32_kernel", lambda: "row_gemm")
    monkeypatch.setattr(prepack, "MIN_NUMEL", 1)


def causal_attend(layer_idx, q, k, v, scaling):  # one sequence, every row a position: causal attention in torch
    rows, heads, _, dim = q.shape
    rep = heads // k.shape[1]
    keys, values = (t[:, :, 0].repeat_interleave(rep, dim=1).transpose(0, 1) for t in (k, v))
    out = F.scaled_dot_product_attention(q[:, :, 0].transpose(0, 1), keys, values, is_causal=True, scale=scaling)
    return out.transpose(0, 1).reshape(rows, heads * dim)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_a_float32_decoder_packed_by_the_row_gemm_uses_them_and_agrees_with_torchs_ops(model_type,
                                                                                         packs_small_matrices):
    model = decoder_model(model_type)
    torch_ops, compiled = FusedDecoder(model, torch.float32), FusedDecoder(model, torch.float32)
    torch_ops.prepack(8)
    torch_ops.compiled_ops = False
    compiled.prepack(8)
    assert compiled.compiled_ops
    tokens, positions = torch.tensor([5, 9, 11, 200, 2, 7, 33, 1]), torch.arange(8)
    with torch.no_grad():
        want = torch_ops.step(tokens, positions, causal_attend)
        got = compiled.step(tokens, positions, causal_attend, select=torch.tensor([2, 7]))
    assert torch.allclose(got, want[[2, 7]], rtol=0, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("why", ["gelu", "bfloat16", "mkl", "norm: torch"])
def test_the_decoder_keeps_torchs_ops_where_they_do_not_apply(why, packs_small_matrices, monkeypatch):
    if why == "mkl":
        monkeypatch.setattr(prepack, "float32_kernel", lambda: "mkl")
    decoder = FusedDecoder(decoder_model("llama", act="gelu" if why == "gelu" else "silu"),
                           torch.bfloat16 if why == "bfloat16" else torch.float32,
                           norm="torch" if why == "norm: torch" else "model")
    decoder.prepack(8)
    assert not decoder.compiled_ops
