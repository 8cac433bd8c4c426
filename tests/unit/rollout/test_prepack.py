"""Prepacked CPU weights of the fused decoder (:mod:`rlflow.rollout.prepack`).

What is checked, for the three float32 kernels on any CPU that has them (the one :func:`~rlflow.rollout.prepack.
float32_kernel` chooses is monkeypatched): through MKL, a packed product is bit-identical to the ``torch.mm`` /
``torch.addmm`` the decoder used before (at the packed row count, fewer rows (zero-padded) and more rows
(unpacked)), a decoder with packed matrices gives bit-identical logits, and a seeded engine on a model large enough
to pack samples exactly the tokens and log-probs it samples with packing switched off; through oneDNN and through
rlflow's row GEMM, each row of a product has the same bits at every row count and thread count, the residual add
is exact, products and logits agree with ``torch.mm``'s to float32 rounding, a seeded engine samples the same
tokens and log-probs on one thread or two (and the unpacked decoder's tokens), and a shape whose rows would depend
on the row count takes MKL's kernel. bfloat16 through oneDNN is bit-identical at any row count, with the residual
add. Small matrices and biased products stay unpacked.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlflow.rollout import prepack, row_gemm
from rlflow.rollout.base import SamplingParams
from rlflow.rollout.engine import EngineRollout
from rlflow.rollout.fused import FusedDecoder
from rlflow.rollout.prepack import PackedWeight, packable
from tests.helpers.tiny_archs import IdTokenizer

needs_mkl = pytest.mark.skipif(not prepack._mkl(), reason="torch built without MKL")
needs_onednn = pytest.mark.skipif(not prepack.packs(torch.bfloat16),
                                  reason="bf16 packing needs torch with oneDNN and a CPU with AMX or AVX512-BF16")


@pytest.fixture
def mkl_float32(monkeypatch):
    """float32 matrices pack through MKL, whatever this CPU's choice."""
    monkeypatch.setattr(prepack, "float32_kernel", lambda: "mkl")


@pytest.fixture
def onednn_float32(monkeypatch):
    """float32 matrices pack through oneDNN, whatever this CPU's choice."""
    monkeypatch.setattr(prepack, "float32_kernel", lambda: "onednn")


@pytest.fixture(params=["onednn", "row_gemm"])
def row_independent_float32(request, monkeypatch):
    """float32 matrices pack through each kernel whose rows do not depend on the row count (oneDNN's, rlflow's
    row GEMM), where this torch and CPU have it; the kernel's name."""
    if request.param == "onednn" and not prepack._onednn():
        pytest.skip("torch built without oneDNN")
    if request.param == "onednn" and not all(PackedWeight.rows_independent(matrix(576, 960, torch.float32), rows=rows)
                                             for rows in (4, 16)):
        pytest.skip("this torch's oneDNN float32 products depend on the row or thread count: the engine packs "
                    "through MKL instead (the mkl_float32 tests; the probe's fallback: the row_gemm cases)")
    if request.param == "row_gemm" and not row_gemm.available():
        pytest.skip(f"the row GEMM does not run here: {row_gemm.unsupported_reason() or 'its build failed'}")
    monkeypatch.setattr(prepack, "float32_kernel", lambda: request.param)
    return request.param


@pytest.mark.parametrize("builds", [True, False])
def test_the_float32_kernel_is_onednn_on_avx2_and_the_row_gemm_on_avx512_where_it_builds(monkeypatch, builds):
    monkeypatch.setattr(row_gemm, "available", lambda: builds)
    avx512 = "row_gemm" if builds else "mkl"
    for capability, want in [("AVX2", "onednn"), ("AVX512", avx512), ("DEFAULT", "mkl")]:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda c=capability: c)
        if prepack._onednn() and prepack._mkl():
            assert prepack.float32_kernel() == want
        assert prepack.rounds_like_mm(torch.float32) == (prepack.float32_kernel() not in ("onednn", "row_gemm"))
        assert prepack.rounds_like_mm(torch.bfloat16)


def matrix(k: int, n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A random ``[k, n]`` weight stored as the fused decoder stores it (``[in, out]``)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=gen).to(dtype).t().contiguous()


@needs_mkl
@pytest.mark.parametrize("rows", [32, 5, 31, 57])
def test_float32_packed_products_are_bit_identical_to_mm(rows, mkl_float32):
    weight_t = matrix(576, 960, torch.float32)
    packed = PackedWeight(weight_t, 32)
    assert packed.mkl
    x = torch.randn(rows, 576)
    assert torch.equal(packed.mm(x), torch.mm(x, weight_t))
    h = torch.randn(rows, 960)
    assert torch.equal(packed.addmm(h, x), torch.addmm(h, x, weight_t))


@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (512, 640)])
def test_row_independent_float32_products_give_each_row_the_same_bits_at_any_row_count_and_thread_count(
        shape, row_independent_float32):
    weight_t = matrix(*shape, torch.float32)
    packed = PackedWeight(weight_t, 16)
    x, h = torch.randn(333, shape[0]), torch.randn(333, shape[1])
    if not PackedWeight.rows_independent(weight_t, kernel=row_independent_float32, rows=16):  # rows depend on it
        assert packed.mkl  # so the matrix packs through MKL, whose products are torch.mm's bits
        assert torch.equal(packed.mm(x[:16]), torch.mm(x[:16], weight_t))
        return
    assert not packed.mkl and packed.kernel == row_independent_float32
    full, full_add = packed.mm(x), packed.addmm(h, x)
    assert torch.equal(full_add, full + h)  # the residual add is one exact float32 add after the product
    scale = torch.mm(x, weight_t).abs().max()
    assert (full - torch.mm(x, weight_t)).abs().max() <= 1e-5 * scale  # torch.mm's value, to float32 rounding
    threads = torch.get_num_threads()
    try:
        for n_threads in (1, 2):
            torch.set_num_threads(n_threads)
            for rows in (1, 2, 5, 12, 13, 16, 17, 57, 333):
                assert torch.equal(packed.mm(x[:rows]), full[:rows]), (n_threads, rows)
                assert torch.equal(packed.addmm(h[:rows], x[:rows]), full_add[:rows]), (n_threads, rows)
    finally:
        torch.set_num_threads(threads)


@needs_mkl
def test_a_shape_whose_rows_would_depend_on_the_row_count_packs_through_mkl(monkeypatch, row_independent_float32):
    kernel = row_independent_float32
    monkeypatch.setattr(prepack, "_ROWS_INDEPENDENT", {})
    weight_t = matrix(576, 960, torch.float32)
    assert PackedWeight.rows_independent(weight_t, kernel=kernel) and PackedWeight(weight_t, 8).kernel == kernel
    real = prepack.ROW_INDEPENDENT_KERNELS[kernel]

    def rounding_at_7_rows(x, h, packed):  # a kernel whose 7-row products round differently
        mm, add = real(x, h, packed)
        return (mm * (1 + 1e-6), add) if x.shape[0] == 7 else (mm, add)

    monkeypatch.setattr(prepack, "_ROWS_INDEPENDENT", {})
    monkeypatch.setitem(prepack.ROW_INDEPENDENT_KERNELS, kernel, rounding_at_7_rows)
    assert not PackedWeight.rows_independent(weight_t, kernel=kernel, rows=8)
    # checked once per kernel, shape and (oneDNN's packing depends on it) row count packed for
    assert prepack._ROWS_INDEPENDENT == {(kernel, 576, 960, 8 if kernel == "onednn" else None): False}
    assert PackedWeight(weight_t, 8).mkl


@needs_mkl
def test_a_kernel_whose_products_change_with_the_thread_count_packs_through_mkl(monkeypatch, row_independent_float32):
    kernel, threads = row_independent_float32, torch.get_num_threads()
    real = prepack.ROW_INDEPENDENT_KERNELS[kernel]
    seen = set()

    def rounding_on_one_thread(x, h, packed):  # every row count alike, but one thread rounds otherwise
        seen.add(torch.get_num_threads())
        mm, add = real(x, h, packed)
        return (mm * (1 + 1e-6), add) if torch.get_num_threads() == 1 else (mm, add)

    monkeypatch.setattr(prepack, "_ROWS_INDEPENDENT", {})
    monkeypatch.setitem(prepack.ROW_INDEPENDENT_KERNELS, kernel, rounding_on_one_thread)
    weight_t = matrix(576, 960, torch.float32)
    assert not PackedWeight.rows_independent(weight_t, kernel=kernel, rows=8)
    assert seen == {1, max(2, threads)} | {threads} and torch.get_num_threads() == threads  # restored
    assert PackedWeight(weight_t, 8).mkl


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
    assert packable(matrix(576, 960, torch.float32)) == prepack.packs(torch.float32)  # float32 still does


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


def attend_alone(layer_idx, q, k, v, scaling):  # each row alone: softmax over one key is 1
    rep = q.shape[1] // v.shape[1]
    return v.repeat_interleave(rep, dim=1).reshape(q.shape[0], -1)


@pytest.mark.parametrize("dtype", [
    pytest.param(torch.float32, marks=needs_mkl), pytest.param(torch.bfloat16, marks=needs_onednn)])
def test_a_prepacked_decoder_gives_bit_identical_logits(dtype, mkl_float32):
    model = packing_llama()
    plain, packed = FusedDecoder(model, dtype), FusedDecoder(model, dtype)
    packed.prepack(6)
    layer = packed.layers[0]
    assert isinstance(layer.qkv_w, PackedWeight)
    assert isinstance(packed.lm_head_w, PackedWeight)  # a 16-bit head: packed where its product agrees with mm
    assert isinstance(layer.down_w, PackedWeight) == (dtype == torch.bfloat16)  # MKL's float32 residuals: addmm
    tokens, positions = torch.tensor([5, 9, 11, 300, 2, 7]), torch.tensor([0, 1, 2, 3, 4, 5])
    for rows in (6, 4):  # the packed count and fewer rows
        want = plain.step(tokens[:rows], positions[:rows], attend_alone)
        assert torch.equal(packed.step(tokens[:rows], positions[:rows], attend_alone), want)


def test_a_row_independent_float32_decoder_packs_every_product_once_and_agrees_to_rounding(row_independent_float32):
    model = packing_llama()
    plain, packed = FusedDecoder(model, torch.float32), FusedDecoder(model, torch.float32)
    packed.prepack(4)
    assert packed.compiled_ops == (row_independent_float32 == "row_gemm")  # rlflow.rollout.decode_ops ride along
    layer = packed.layers[0]
    assert all(isinstance(w, PackedWeight) for w in (layer.qkv_w, layer.gate_up_w, layer.o_w, layer.down_w))
    assert isinstance(packed.lm_head_w, PackedWeight)
    first = packed.lm_head_w
    packed.prepack(64)  # more rows than packed for: these packs fit every row count, nothing is packed again
    assert packed.lm_head_w is first and packed.packed_rows == 4
    tokens, positions = torch.tensor([5, 9, 11, 300, 2, 7]), torch.tensor([0, 1, 2, 3, 4, 5])
    with torch.no_grad():  # as the engine decodes
        want = plain.step(tokens, positions, attend_alone)
        got = packed.step(tokens, positions, attend_alone)
        assert not torch.equal(got, want) and torch.allclose(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))
        for rows in (1, 4):  # each row's logits whatever the rows beside it
            assert torch.equal(packed.step(tokens[:rows], positions[:rows], attend_alone), got[:rows])


def packing_model(arch: str) -> torch.nn.Module:
    """A one-layer decoder of ``arch`` whose matrices are large enough to pack: Llama with a head dim of 80 (an
    attention scale that is not a power of two), Qwen2 (q/k/v biases), Qwen3 (q/k norms); ``+lora``: under PEFT
    LoRA adapters on q, v and down."""
    torch.manual_seed(1)
    lora = arch.endswith("+lora")
    arch = arch.removesuffix("+lora")
    extra = {"llama": {"hidden_size": 640}, "qwen2": {}, "qwen3": {"head_dim": 64}}[arch]
    config = AutoConfig.for_model(arch, **{"hidden_size": 512, **extra}, vocab_size=640, intermediate_size=1024,
                                  num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4,
                                  max_position_embeddings=256, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norm weights other than ones, so that folding them shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    if lora:  # adapters whose deltas are not zero
        peft = pytest.importorskip("peft")
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
        model = peft.get_peft_model(model, config).eval()
    return model


def decoder_weights(decoder: FusedDecoder) -> list:
    """The decoder's matrices, biases and norm weights, in one order."""
    out = [decoder.lm_head_w, decoder.lm_head_b, decoder.norm_w]
    for layer in decoder.layers:
        out += [layer.qkv_w, layer.gate_up_w, layer.o_w, layer.down_w, layer.qkv_b, layer.o_b, layer.ln1_w,
                layer.ln2_w, layer.qk_norm[0] if layer.qk_norm is not None else None]
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "llama+lora"])
def test_a_decoder_packed_as_it_is_built_equals_one_packed_afterwards(arch, row_independent_float32):
    """``pack_rows``: the row GEMM's panels come straight from the model's weights (norm weights and the attention
    scale folded in), bit for bit the panels of the copies a decoder packs afterwards, with no ``[in, out]`` copy
    kept (made from the panels when asked); the same logits; the model's weights untouched. Through oneDNN (not
    packed straight) the decoder is packed as it is built, likewise."""
    model = packing_model(arch)
    before = {name: p.clone() for name, p in model.named_parameters()}
    afterwards = FusedDecoder(model)
    afterwards.prepack(4)
    built = FusedDecoder(model, pack_rows=4)
    assert built.packed_rows == 4 and built.compiled_ops == afterwards.compiled_ops
    straight = 0
    for mine, theirs in zip(decoder_weights(built), decoder_weights(afterwards), strict=True):
        assert type(mine) is type(theirs)
        if isinstance(mine, PackedWeight):
            assert mine.kernel == theirs.kernel == row_independent_float32
            if mine.kernel == "row_gemm":  # oneDNN's packed copies are opaque: compared through the logits
                assert torch.equal(mine.packed, theirs.packed)
            straight += mine._weight_t is None
            assert torch.equal(mine.weight_t, theirs.weight_t)
        elif mine is not None:
            assert torch.equal(mine, theirs)
    biased = arch == "qwen2"  # q/k/v with a bias stays a copy, unpacked
    assert straight == (5 - biased if row_independent_float32 == "row_gemm" else 0)  # the LM head and 4 a layer
    tokens, positions = torch.tensor([5, 9, 11, 300, 2, 7]), torch.tensor([0, 1, 2, 3, 4, 5])
    with torch.no_grad():
        assert torch.equal(built.step(tokens, positions, attend_alone),
                           afterwards.step(tokens, positions, attend_alone))
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    if arch.endswith("+lora"):  # the adapters' deltas are in the panels
        with model.disable_adapter():
            base = FusedDecoder(model, pack_rows=4)
        assert not torch.equal(base.layers[0].qkv_w.weight_t, built.layers[0].qkv_w.weight_t)


def test_a_decoder_is_packed_as_it_is_built_only_where_packed_products_round_unlike_mm(mkl_float32):
    model = packing_model("llama")
    built = FusedDecoder(model, pack_rows=4)  # MKL's products round like torch.mm: packed at the first product
    assert built.packed_rows == 0 and isinstance(built.layers[0].qkv_w, torch.Tensor)
    assert PackedWeight.of_rows([torch.randn(640, 640)], None, [1.0], 4) is None  # not the row GEMM's to pack


@pytest.mark.skipif(not row_gemm.available(), reason="the row GEMM does not run here")
def test_matrices_too_small_or_not_float32_are_not_packed_straight():
    assert PackedWeight.of_rows([torch.randn(128, 256)], None, [1.0], 4) is None  # under MIN_NUMEL
    assert PackedWeight.of_rows([torch.randn(640, 640, dtype=torch.bfloat16)], None, [1.0], 4) is None
    assert PackedWeight.of_rows([torch.randn(640, 640).t()], None, [1.0], 4) is None  # columns apart


def engine_samples(model, dtype: str, max_batch_size: int = 8):
    """A seeded engine's tokens and log-probs for 3 prompts x 3 (at most ``max_batch_size`` rows at once)."""
    prompts = [[3, 17, 250, 31, 44, 9, 100], [3, 17, 250, 31, 8], [3, 17, 250, 31, 44, 9, 12, 600, 5]]
    engine = EngineRollout(seed=7, dtype=dtype, min_shared_prefix=4, max_batch_size=max_batch_size)
    engine.bind(model, IdTokenizer())
    groups = engine.generate(prompts, SamplingParams(1.0, max_tokens=12), n=3)  # groups join behind others
    return engine, [(c.token_ids, c.logprobs) for g in groups for c in g]


@pytest.mark.parametrize("dtype", [
    pytest.param("model", marks=needs_mkl), pytest.param("bfloat16", marks=needs_onednn)])
def test_a_seeded_engine_samples_the_same_tokens_with_and_without_packing(dtype, monkeypatch, one_thread,
                                                                          mkl_float32):
    model = packing_llama()
    engine, packed = engine_samples(model, dtype)
    assert engine._kept_decoder[1].packed_rows > 0
    monkeypatch.setattr(prepack, "MIN_NUMEL", 1 << 40)  # nothing packs
    engine, plain = engine_samples(model, dtype)
    assert isinstance(engine._kept_decoder[1].lm_head_w, torch.Tensor)
    assert packed == plain


def test_a_seeded_row_independent_float32_engine_samples_the_same_on_one_thread_or_two(monkeypatch,
                                                                                      row_independent_float32):
    """Packed before its first prefill, every product rounds alike on any thread count: one thread and two sample
    the same tokens and log-probs; the unpacked decoder samples the same tokens, log-probs equal to rounding."""
    model = packing_llama()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        engine, one = engine_samples(model, "model")
        assert engine._kept_decoder[1].packed_rows > 0
        assert engine._kept_decoder[1].compiled_ops == (row_independent_float32 == "row_gemm")
        straight = engine._kept_decoder[1].layers[0].qkv_w._weight_t is None  # packed from the model's weights
        assert straight == (row_independent_float32 == "row_gemm")
        torch.set_num_threads(2)
        assert engine_samples(model, "model")[1] == one
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(prepack, "MIN_NUMEL", 1 << 40)  # nothing packs
    plain = engine_samples(model, "model")[1]
    assert [tokens for tokens, _ in plain] == [tokens for tokens, _ in one]
    for (_, want), (_, got) in zip(plain, one):
        assert got == pytest.approx(want, abs=1e-4)


@needs_mkl
def test_a_row_count_whose_packed_product_rounds_differently_runs_unpacked(monkeypatch, mkl_float32):
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


def test_an_engine_on_a_model_too_small_to_pack_never_looks_up_the_float32_kernel(monkeypatch):
    """The row GEMM is compiled the first time the float32 kernel is asked for: a small model never asks."""
    def asked():
        raise AssertionError("the float32 kernel was looked up")

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=640, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    model = AutoModelForCausalLM.from_config(config).eval()
    monkeypatch.setattr(prepack, "float32_kernel", asked)
    engine, samples = engine_samples(model, "model")
    assert engine._kept_decoder[1].large_enough_to_pack() is False
    assert len(samples) == 9 and all(len(tokens) > 0 for tokens, _ in samples)
    with pytest.raises(Exception, match="float32 kernel was looked up"):  # a model with matrices to pack does
        engine_samples(packing_llama(), "model")


@needs_mkl
def test_an_avx512_engine_whose_row_gemm_cannot_be_built_packs_through_mkl(monkeypatch):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr(row_gemm, "available", lambda: False)
    engine, samples = engine_samples(packing_llama(), "model")
    decoder = engine._kept_decoder[1]
    assert decoder.packed_rows > 0 and decoder.layers[0].qkv_w.kernel == "mkl"
    assert len(samples) == 9 and all(len(tokens) > 0 for tokens, _ in samples)


@pytest.mark.parametrize("kernel, words", [("mkl", "MKL's packed float32 products"),
                                           ("row_gemm", "rlflow's row GEMM for float32 products"),
                                           ("onednn", "oneDNN's packed float32 products")])
def test_the_engines_start_up_line_names_what_multiplies_a_packed_float32_model(monkeypatch, kernel, words):
    if kernel == "mkl" and not prepack._mkl() or kernel == "onednn" and not prepack._onednn():
        pytest.skip(f"torch built without {kernel}")
    if kernel == "row_gemm" and not row_gemm.available():
        pytest.skip("the row GEMM does not run here")
    monkeypatch.setattr(prepack, "float32_kernel", lambda: kernel)
    engine = EngineRollout(seed=0, dtype="model")
    engine.bind(packing_llama(), IdTokenizer())
    assert engine.decode_path == f"fused decode, {words}"
    small = EngineRollout(seed=0, dtype="model")  # nothing large enough to pack: nothing said of products
    config = AutoConfig.for_model("llama", vocab_size=640, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    small.bind(AutoModelForCausalLM.from_config(config).eval(), IdTokenizer())
    assert small.decode_path == "fused decode"
