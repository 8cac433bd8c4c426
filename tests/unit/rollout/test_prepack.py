"""Prepacked CPU weights of the fused decoder (:mod:`rlflow.rollout.prepack`).

What is checked: a packed product is bit-identical to the ``torch.mm`` / ``torch.addmm`` the decoder used
before (float32 through MKL at the packed row count, fewer rows (zero-padded) and more rows (unpacked);
bfloat16 through oneDNN at any row count, with the residual add); a decoder with packed matrices gives
bit-identical logits; a seeded engine on a model large enough to pack samples exactly the tokens and log-probs
it samples with packing switched off; small matrices and biased products stay unpacked.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlflow.rollout import prepack
from rlflow.rollout.base import SamplingParams
from rlflow.rollout.engine import EngineRollout
from rlflow.rollout.fused import FusedDecoder
from rlflow.rollout.prepack import PackedWeight, packable
from tests.helpers.tiny_archs import IdTokenizer

needs_mkl = pytest.mark.skipif(not prepack._available(torch.float32), reason="torch built without MKL")
needs_onednn = pytest.mark.skipif(not prepack._available(torch.bfloat16),
                                  reason="bf16 packing needs torch with oneDNN and a CPU with AMX or AVX512-BF16")


def matrix(k: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A random ``[k, n]`` weight stored as the fused decoder stores it (``[in, out]``)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen).to(dtype).t().contiguous()


@needs_mkl
@pytest.mark.parametrize("rows", [32, 5, 31, 57])
def test_float32_packed_products_are_bit_identical_to_mm(rows):
    weight_t = matrix(576, 960, torch.float32)
    packed = PackedWeight(weight_t, 32)
    x = torch.randn(rows, 576)
    assert torch.equal(packed.mm(x), torch.mm(x, weight_t))
    h = torch.randn(rows, 960)
    assert torch.equal(packed.addmm(h, x), torch.addmm(h, x, weight_t))


@needs_onednn
@pytest.mark.parametrize("rows", [1, 24, 32, 100, 333])
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576)])
def test_bfloat16_packed_products_are_bit_identical_to_mm_and_addmm(rows, shape):
    weight = torch.randn(shape[1], shape[0]).to(torch.bfloat16)  # [out, in], as FusedDecoder casts it
    weight_t = weight.t()  # the layers' 16-bit weights are transposed views (the LM head is not packed)
    packed = PackedWeight(weight_t, 32)
    x = torch.randn(rows, shape[0]).to(torch.bfloat16)
    h = torch.randn(rows, shape[1]).to(torch.bfloat16)
    assert torch.equal(packed.mm(x), torch.mm(x, weight_t))
    assert torch.equal(packed.addmm(h, x), torch.addmm(h, x, weight_t))


def test_bfloat16_does_not_pack_where_the_cpu_emulates_it(monkeypatch):
    """Emulated bf16 ``mm`` takes other kernels at some row counts and rounds unlike the packed product."""
    monkeypatch.setattr(prepack, "native_bf16", lambda device: False)
    assert not packable(matrix(576, 960, torch.bfloat16))
    assert packable(matrix(576, 960, torch.float32)) == prepack._available(torch.float32)  # float32 still does


def test_small_matrices_and_other_dtypes_do_not_pack():
    assert not packable(matrix(128, 384, torch.float32))  # under MIN_NUMEL: in cache, nothing to gain
    assert not packable(matrix(576, 960, torch.float16))
    with pytest.raises(ValueError, match="cannot pack"):
        PackedWeight(matrix(128, 384, torch.float32), 8)


def packing_llama(seed: int = 0) -> torch.nn.Module:
    """A one-layer Llama whose q/k/v, gate/up and LM head matrices are large enough to pack."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model("llama", vocab_size=640, hidden_size=512, intermediate_size=1024,
                                  num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4,
                                  max_position_embeddings=256, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("dtype", [
    pytest.param(torch.float32, marks=needs_mkl), pytest.param(torch.bfloat16, marks=needs_onednn)])
def test_a_prepacked_decoder_gives_bit_identical_logits(dtype):
    model = packing_llama()
    plain, packed = FusedDecoder(model, dtype), FusedDecoder(model, dtype)
    packed.prepack(6)
    layer = packed.layers[0]
    assert isinstance(layer.qkv_w, PackedWeight)
    assert isinstance(packed.lm_head_w, PackedWeight)  # a 16-bit head: packed where its product agrees with mm
    assert isinstance(layer.down_w, PackedWeight) == (dtype == torch.bfloat16)  # float32 residuals stay addmm
    tokens, positions = torch.tensor([5, 9, 11, 300, 2, 7]), torch.tensor([0, 1, 2, 3, 4, 5])

    def attend(layer_idx, q, k, v, scaling):  # each row alone: softmax over one key is 1
        rep = q.shape[1] // v.shape[1]
        return v.repeat_interleave(rep, dim=1).reshape(q.shape[0], -1)

    for rows in (6, 4):  # the packed count and fewer rows
        want = plain.step(tokens[:rows], positions[:rows], attend)
        assert torch.equal(packed.step(tokens[:rows], positions[:rows], attend), want)


@pytest.mark.parametrize("dtype", [
    pytest.param("model", marks=needs_mkl), pytest.param("bfloat16", marks=needs_onednn)])
def test_a_seeded_engine_samples_the_same_tokens_with_and_without_packing(dtype, monkeypatch, one_thread):
    model = packing_llama()
    prompts = [[3, 17, 250, 31, 44, 9, 100], [3, 17, 250, 31, 8], [3, 17, 250, 31, 44, 9, 12, 600, 5]]
    params = SamplingParams(1.0, max_tokens=12)

    def sample():
        engine = EngineRollout(seed=7, dtype=dtype, min_shared_prefix=4, max_batch_size=8)
        engine.bind(model, IdTokenizer())
        groups = engine.generate(prompts, params, n=3)  # 9 rows, at most 8 at once: groups join behind others
        return engine, [(c.token_ids, c.logprobs) for g in groups for c in g]

    engine, packed = sample()
    assert engine._kept_decoder[1].packed_rows > 0
    monkeypatch.setattr(prepack, "MIN_NUMEL", 1 << 40)  # nothing packs
    engine, plain = sample()
    assert isinstance(engine._kept_decoder[1].lm_head_w, torch.Tensor)
    assert packed == plain


@needs_mkl
def test_a_row_count_whose_packed_product_rounds_differently_runs_unpacked(monkeypatch):
    """Where this CPU's ``torch.mm`` takes another kernel for a row count, the packed product is not used for it."""
    monkeypatch.setattr(prepack, "_AGREES", {})
    weight_t = matrix(576, 960, torch.float32)
    packed = PackedWeight(weight_t, 32)
    real = packed._mkl_mm
    monkeypatch.setattr(packed, "_mkl_mm", lambda x: real(x) * (1 + 1e-6) if x.shape[0] == 7 else real(x))
    x = torch.randn(7, 576)
    assert not packed.agrees(7) and torch.equal(packed.mm(x), torch.mm(x, weight_t))
    assert prepack._AGREES[(7, 32, 576, 960)] is False  # checked once
    honest = PackedWeight(weight_t, 32)
    assert honest.agrees(32) and torch.equal(honest.mm(torch.ones(32, 576)), honest._mkl_mm(torch.ones(32, 576)))


@needs_onednn
def test_a_checked_bfloat16_head_runs_unpacked_at_a_row_count_whose_packed_product_rounds_differently(monkeypatch):
    """The 16-bit LM head is a physically transposed copy, whose ``torch.mm`` may take another kernel than oneDNN's
    packed product: it is packed ``checked``, each row count compared once with ``torch.mm``."""
    monkeypatch.setattr(prepack, "_AGREES", {})
    weight_t = torch.randn(640, 512).to(torch.bfloat16).t().contiguous()  # [in, out], physically transposed
    packed = PackedWeight(weight_t, 6, checked=True)
    real = packed._packed_mm
    monkeypatch.setattr(packed, "_packed_mm", lambda x: real(x) * 2 if x.shape[0] == 3 else real(x))
    x = torch.randn(3, 512).to(torch.bfloat16)
    assert not packed.agrees(3) and torch.equal(packed.mm(x), torch.mm(x, weight_t))
    assert packed.agrees(6) and torch.equal(packed.mm(torch.ones(6, 512, dtype=torch.bfloat16)),
                                            real(torch.ones(6, 512, dtype=torch.bfloat16)))
    assert len(prepack._AGREES) == 2  # each row count checked once
    unchecked = PackedWeight(weight_t, 6)  # the layers' products: bit-identical by construction, never checked
    unchecked.mm(x)
    assert len(prepack._AGREES) == 2
