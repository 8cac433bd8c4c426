"""A decode step of Qwen2/Qwen3/Llama-style decoders written with plain torch ops over the live weights.

Why: at rollout batch sizes a decode step of a small model is dominated by the framework around the maths, not
by the maths: transformers' forward goes through ~30 modules, output-recording hooks, a cache object and a mask
builder per token. The engine (:mod:`rlflow.rollout.engine`) calls :meth:`FusedDecoder.step` instead (for its
prefills too, with a causal ``attend``): the same operations (so the logits agree with the model's forward to
float rounding; ``tests/test_fused_decoder.py`` checks it) with q/k/v and gate/up each folded into one
pre-transposed matrix product and the residual adds inside ``addmm``. With float32 weights the RMSNorm weights
before q/k/v, gate/up and the head are folded into those matrices and the attention scale into q (or into q's
RMSNorm weight); the rotary cos/sin come from a table built once per decoder (positions looked up, not
recomputed), and ``rotate_half(x) * sin`` is ``roll(x, dim / 2) * (sign * sin)``, exactly. Each fold moves one
float rounding, so logits agree with the model's forward to float32 precision; other dtypes keep the model's
own order of operations. On a CPU the engine has the large matrices packed once per decoder in the GEMM library's
own layout at its first decode step (:meth:`FusedDecoder.prepack`, :mod:`rlflow.rollout.prepack`; the products
are bit-identical, the per-call repacking of the weight operand is gone), or, with float32 weights on an AVX2 CPU,
in oneDNN's layout as soon as the decoder is built (its products round unlike ``torch.mm``'s, each row alike at any
row count and thread count: every product of the decoder then takes it). A 16-bit matrix that nothing packs (on a
CPU without bf16 units) keeps ``nn.Linear``'s layout, whose software 16-bit products run far faster there than
those of a transposed copy (:func:`_transposed`). Where rlflow's row GEMM packs a float32 decoder (AVX-512 CPUs),
the operations around the products (norms, RoPE, SiLU times up, the decode attention) are compiled calls of
:mod:`rlflow.rollout.decode_ops` (:attr:`FusedDecoder.compiled_ops`), one each where torch takes several operators,
and the engine has the matrices packed as the decoder is built (``pack_rows``): the row GEMM's panels are made
straight from the model's weights, norm weights and attention scale folded in (one pass over the weights after
every optimizer step, where concatenating, folding, transposing and packing took four; no ``[in, out]`` copy kept).

With ``dtype`` (:class:`FusedDecoder`'s argument; the engine's ``dtype`` option) the decoder computes in another
dtype than the live weights': its weight copies are made in that dtype (bfloat16 copies of float32 master
weights, as vLLM and lmdeploy decode), with the model's own order of operations for that dtype, so its logits are
those of the model cast to ``dtype`` up to rounding (no folds: they would round differently from that model).
The engine's KV caches are then in that dtype too (half the bytes a decode step's attention reads). An
:class:`~rlflow.models.lm_head.FP32Linear` head (``model.policy.cast_lm_head_to_fp32``) keeps a float32 copy and its
product in
float32 whatever ``dtype`` is. With ``norm`` (the engine's ``norm`` option; by default on a CUDA GPU in 16 bits) the
RMS norms run as ``F.rms_norm``, one kernel instead of eight, rounding once where the model rounds twice.

LoRA (PEFT) projections are folded: each one's weight copy is its base weight plus the adapters' delta
(:func:`rlflow.models.lora.linear_weights`), computed when the decoder is built, so a rollout samples from the adapted
model; DoRA and other variants are refused (the engine then decodes through the model's forward).

Simplifications: only the architectures listed in :data:`SUPPORTED_MODEL_TYPES` (RMSNorm, rotary embeddings from
the model's own ``rotary_emb``, optional q/k RMSNorm as in Qwen3, optional projection biases as in Qwen2,
SwiGLU-style MLP, full attention); weights must be plain tensors on one device (FSDP-sharded DTensors are not,
so the engine falls back to the model's forward there). The folded q/k/v and gate/up matrices are copies made
once per :class:`FusedDecoder`: build a new one after every optimizer step (the engine keeps one while the
weights are unchanged and builds a new one when they changed).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rlflow.models.lm_head import is_fp32_head
from rlflow.models.lora import fold_problem, linear_weights, unwrap_peft
from rlflow.rollout import decode_ops
from rlflow.rollout.prepack import PackedWeight, large_enough, packable, packs, rounds_like_mm

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")


STATIC_ROPE_TYPES = ("default", "linear", "llama3")  # frequencies that do not depend on the sequence length


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm``/``Qwen3RMSNorm``: ``weight * x / sqrt(mean(x^2) + eps)``, computed in float32
    (``weight`` None: folded into the next matrix product)."""
    h = x.float()
    normed = h * (h * h).mean(-1, keepdim=True).add_(eps).rsqrt_()  # transformers' own formula, in 4 ops
    if weight is None:
        return normed
    return weight * normed.to(x.dtype)


def _torch_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The same norm through ``F.rms_norm``: one kernel on a CUDA GPU, where the formula above is six kernels plus
    two casts, each a launch in a launch-bound decode step. Its statistics are float32 as above, but it applies the
    weight before its one rounding to ``x``'s dtype, where the model rounds twice (the normed values, then their
    product with the weight): in 16 bits its output differs from the model's forward by rounding. Qwen3's stacked
    q/k norm weights (one row per head) are applied after it, as the model does."""
    if weight is not None and weight.dim() > 1:
        return weight * F.rms_norm(x, (x.shape[-1],), None, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


NORMS = ("auto", "model", "torch")


def torch_norm_for(choice: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the decoder's RMS norms go through ``F.rms_norm`` for the engine's ``norm`` option: ``auto`` where
    the decoder computes in 16 bits on a CUDA GPU (there ``F.rms_norm`` is one fused kernel where the formula is
    eight; in float32 the model's formula keeps the logits exact, and on a CPU the two take about as long, so the
    model's roundings are kept)."""
    if choice not in NORMS:
        raise ValueError(f"engine norm must be one of {', '.join(NORMS)}; got {choice!r}")
    if choice == "auto":
        return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    return choice == "torch"


def _linear(x: torch.Tensor, weight_t: torch.Tensor | PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` with the weight stored transposed (``[in, out]``, contiguous: the faster layout for ``mm``), or
    prepacked (:mod:`rlflow.rollout.prepack`; only matrices without a bias are)."""
    if isinstance(weight_t, PackedWeight):
        return weight_t.mm(x)
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


def _residual(
    h: torch.Tensor, x: torch.Tensor, weight_t: torch.Tensor | PackedWeight, bias: torch.Tensor | None
) -> torch.Tensor:
    """``h + F.linear(x, weight, bias)``; without a bias the residual add rides in the matrix product (addmm)."""
    if isinstance(weight_t, PackedWeight):
        return weight_t.addmm(h, x)
    return torch.addmm(h, x, weight_t) if bias is None else h + torch.addmm(bias, x, weight_t)


def _packed(
    weight_t: torch.Tensor | PackedWeight, bias: torch.Tensor | None, rows: int, residual: bool = False,
    checked: bool = False,
) -> torch.Tensor | PackedWeight:
    """``weight_t`` packed for products of ``rows`` rows where :mod:`rlflow.rollout.prepack` packs it (no bias; a
    float32 residual product stays ``addmm`` where packed products round like ``torch.mm``; ``checked``: a 16-bit
    product packed only for the row counts where it equals ``torch.mm``), else as it is."""
    if isinstance(weight_t, PackedWeight) and not weight_t.mkl:  # oneDNN's and the row GEMM's fit every row count
        return weight_t
    plain = weight_t.weight_t if isinstance(weight_t, PackedWeight) else weight_t
    if bias is not None or not packable(plain):
        return plain
    packed = PackedWeight(plain, rows, checked=checked)
    return plain if residual and packed.mkl else packed


def _cat(
    *linears: tuple[torch.Tensor, torch.Tensor | None], dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Concatenated weights and biases (None if no projection has one) of ``(weight, bias)`` pairs, the weights
    those the projections apply (:func:`rlflow.models.lora.linear_weights`: under LoRA, base plus the adapters' delta);
    the weights cast to ``dtype`` first (None: kept)."""
    weight = torch.cat([w if dtype is None else w.to(dtype) for w, _ in linears])
    if all(b is None for _, b in linears):
        return weight, None
    return weight, torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in linears])


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``t`` in ``dtype`` (None: as it is)."""
    return t if t is None or dtype is None else t.to(dtype)


def _transposed(weight: torch.Tensor, dtype: torch.dtype | None, head: bool = False) -> torch.Tensor:
    """``weight`` (``[out, in]``) as ``[in, out]`` for :func:`_linear`, in ``dtype`` (None: its own): a contiguous
    transposed copy in its own dtype (the faster layout for a float32 ``mm`` at decode batch sizes), or in another
    dtype the transposed view of a plain cast (a transposing copy costs much more than a cast, and bf16 ``mm`` at
    decode sizes runs about as fast on either layout), except the LM head (``head``), which is copied transposed.
    A 16-bit matrix on a CPU that does not pack it (:func:`~rlflow.rollout.prepack.packs`: no AMX or AVX512-BF16,
    or float16) is always the transposed view, ``nn.Linear``'s own layout: there ``torch.mm`` of a contiguous
    ``[in, out]`` 16-bit matrix takes a slower kernel path than of the view (on an AVX2 CPU, 15-60x at 1-16 rows)."""
    target = dtype or weight.dtype
    if weight.device.type == "cpu" and target in (torch.bfloat16, torch.float16) and not packs(target):
        return weight.to(target).t()
    if dtype is None or head:
        return weight.to(target).t().contiguous()  # cast first: a converting transpose is slower
    return weight.to(dtype).t()


def _folded(
    linears: list[tuple[torch.Tensor, torch.Tensor | None]], col_scale: torch.Tensor | None,
    row_scales: list[float], dtype: torch.dtype | None, rows: int = 0,
) -> tuple[torch.Tensor | PackedWeight, torch.Tensor | None]:
    """The weight for :func:`_linear` and the bias (None if no projection has one) of ``(weight, bias)`` pairs
    concatenated (:func:`_cat`), the weight times ``col_scale`` (a folded norm weight; None: none) and each
    projection's rows (and bias) then times its row scale (the attention scale folded into q; 1: none), copied in
    ``dtype``. With ``rows`` (the decoder packs its matrices now) a float32 matrix without a bias is packed straight
    from the projections' weights where the row GEMM packs it (:meth:`PackedWeight.of_rows`: the same bits as
    packing the copy made here, in one pass); else the transposed copy (:func:`_transposed`)."""
    if rows and dtype is None and all(b is None for _, b in linears):
        packed = PackedWeight.of_rows([w for w, _ in linears], col_scale, row_scales, rows)
        if packed is not None:
            return packed, None
    plain = len(linears) == 1 and col_scale is None and row_scales == [1.0]  # nothing multiplied in place
    weight, bias = _cast_pair(linears[0], dtype) if plain else _cat(*linears, dtype=dtype)
    if col_scale is not None:
        weight = weight * col_scale
    start = 0
    for (w, _), scale in zip(linears, row_scales):
        if scale != 1.0:
            weight[start: start + w.shape[0]] *= scale
            if bias is not None:
                bias[start: start + w.shape[0]] *= scale
        start += w.shape[0]
    return _transposed(weight, dtype), _cast(bias, dtype)


def _cast_pair(linear: tuple[torch.Tensor, torch.Tensor | None], dtype: torch.dtype | None):
    """One projection's ``(weight, bias)``, the weight cast to ``dtype`` (None: kept), the bias as it is."""
    weight, bias = linear
    return (weight if dtype is None else weight.to(dtype)), bias


class _Layer:
    """One decoder layer's weights, with q/k/v and gate/up concatenated (and, with ``fold``, the norms' weights
    and the attention scale folded in), copied in ``dtype`` (None: the weights' own); with ``rows``, float32
    matrices packed straight from the model's weights where the row GEMM packs them (:func:`_folded`)."""

    def __init__(self, layer: torch.nn.Module, fold: bool, dtype: torch.dtype | None = None, rows: int = 0) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1_w, self.ln1_eps = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        post_norm = layer.post_attention_layernorm
        self.ln2_w, self.ln2_eps = post_norm.weight, post_norm.variance_epsilon
        self.q_size, self.kv_size = attn.q_proj.out_features, attn.k_proj.out_features
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.qk_norm = None  # Qwen3: RMSNorm over each head of q and k; one op over both with a stacked weight
        if q_norm is not None and k_norm is not None and q_norm.variance_epsilon == k_norm.variance_epsilon:
            heads, kv_heads = self.q_size // q_norm.weight.numel(), self.kv_size // k_norm.weight.numel()
            weight = torch.cat([q_norm.weight.expand(heads, -1), k_norm.weight.expand(kv_heads, -1)])
            self.qk_norm = (weight, q_norm.variance_epsilon)
        elif q_norm is not None or k_norm is not None:
            raise ValueError("FusedDecoder: q_norm and k_norm must both exist with one epsilon")
        self.scaling = attn.scaling
        # W @ (g * x) == (W * g) @ x; scale * q == q computed with scaled weights (RoPE is linear), or Qwen3's
        # q norm weight times the scale
        ln1, ln2 = (self.ln1_w, self.ln2_w) if fold else (None, None)
        q_scale = self.scaling if fold and self.qk_norm is None else 1.0
        qkv = [linear_weights(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
        self.qkv_w, self.qkv_b = _folded(qkv, ln1, [q_scale, 1.0, 1.0], dtype, rows)
        gate_up = [linear_weights(mlp.gate_proj), linear_weights(mlp.up_proj)]
        self.gate_up_w, self.gate_up_b = _folded(gate_up, ln2, [1.0, 1.0], dtype, rows)
        self.o_w, self.o_b = _folded([linear_weights(attn.o_proj)], None, [1.0], dtype, rows)
        self.down_w, self.down_b = _folded([linear_weights(mlp.down_proj)], None, [1.0], dtype, rows)
        if fold:
            if self.qk_norm is not None:
                weight, eps = self.qk_norm
                self.qk_norm = (torch.cat([weight[:heads] * self.scaling, weight[heads:]]), eps)
            self.ln1_w = self.ln2_w = None
            self.scaling = 1.0
        self.inter = mlp.gate_proj.out_features
        self.act = mlp.act_fn
        self.ln1_w, self.ln2_w = _cast(self.ln1_w, dtype), _cast(self.ln2_w, dtype)
        if self.qk_norm is not None:
            self.qk_norm = (_cast(self.qk_norm[0], dtype), self.qk_norm[1])

    def pack(self, rows: int) -> None:
        """Prepack the layer's matrices for products of ``rows`` rows (:func:`_packed`)."""
        self.qkv_w = _packed(self.qkv_w, self.qkv_b, rows)
        self.gate_up_w = _packed(self.gate_up_w, self.gate_up_b, rows)
        self.o_w = _packed(self.o_w, self.o_b, rows, residual=True)
        self.down_w = _packed(self.down_w, self.down_b, rows, residual=True)


class FusedDecoder:
    """The decode-step forward of a supported decoder over its live weights (see the module docstring)."""

    @torch.no_grad()
    def __init__(self, model: Any, dtype: torch.dtype | None = None, norm: str = "model", pack_rows: int = 0) -> None:
        """
        Args:
            model: The live model (a supported decoder, optionally under PEFT LoRA).
            dtype: Dtype of the decoder's weight copies and arithmetic; None: the model's own.
            norm: RMS norms by the model's formula (``model``), through ``F.rms_norm`` (``torch``), or ``auto``
                (:func:`torch_norm_for`).
            pack_rows: Where packed products round unlike ``torch.mm`` on a CPU
                (:func:`~rlflow.rollout.prepack.rounds_like_mm`), pack the matrices for products of this many rows
                as the decoder is built (:meth:`prepack`; the row GEMM's straight from the model's weights, without
                an ``[in, out]`` copy), so that every product of the decoder takes the packed kernel; 0: not now.
        """
        reason = self.unsupported_reason(model)
        if reason:
            raise ValueError(f"FusedDecoder: {reason}")
        model = unwrap_peft(model)
        config, inner = model.config, model.model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.embed = inner.embed_tokens.weight  # looked up in its own dtype, the rows cast (no copy of the table)
        own = inner.norm.weight.dtype  # the layers' dtype (a tied embedding may be float32: cast_lm_head_to_fp32)
        self.dtype = dtype or own
        cast = None if self.dtype == own else self.dtype
        self.rotary = inner.rotary_emb
        self.silu = getattr(config, "hidden_act", None) in ("silu", "swish")  # the MLPs' act_fn is SiLU
        self.fold = own == torch.float32 and self.dtype == torch.float32
        self.cast = cast
        pack_rows = pack_rows if self.embed.device.type == "cpu" else 0  # packing is for CPU matrices only
        self.layers = [_Layer(layer, self.fold, cast, pack_rows) for layer in inner.layers]
        self.norm_eps = inner.norm.variance_epsilon
        self.head_fp32 = is_fp32_head(model.lm_head)  # model.policy.cast_lm_head_to_fp32: the product in float32
        self.norm_w, self.lm_head_w, self.lm_head_b = self._head(model, pack_rows)
        self.rms_norm = _torch_rms_norm if torch_norm_for(norm, self.dtype, self.embed.device) else _rms_norm
        self.rope_table = getattr(self.rotary, "rope_type", "default") in STATIC_ROPE_TYPES
        self._table = None  # [positions, 2, dim]: cos, and sin with rotate_half's sign folded in
        self.packed_rows = 0  # the row count the matrices are packed for (prepack); 0: not packed
        self.packed_per_rows = False  # whether a matrix is packed for that row count (MKL's float32 packs)
        self.compiled_ops = False  # whether norms, RoPE, SiLU * up and decode attention are decode_ops' (prepack)
        if pack_rows and self.large_enough_to_pack() and not rounds_like_mm(self.dtype):
            self.prepack(pack_rows)

    def _head(self, model: Any, rows: int = 0) -> tuple[torch.Tensor | None, torch.Tensor | PackedWeight,
                                                           torch.Tensor | None]:
        """``(final norm weight, LM head [in, out], its bias)`` of ``model`` (unwrapped) as this decoder holds
        them: the norm folded into the head in float32, copies in the decoder's dtype (the head in float32 under
        ``cast_lm_head_to_fp32``), the head transposed as :func:`_transposed` lays it out (with ``rows``, packed
        straight from the weights where the row GEMM packs it: :meth:`PackedWeight.of_rows`)."""
        head_cast = torch.float32 if self.head_fp32 else self.cast
        norm_w, head_w, bias = model.model.norm.weight, model.lm_head.weight, model.lm_head.bias
        if self.fold and rows and bias is None:
            packed = PackedWeight.of_rows([head_w], norm_w, [1.0], rows)
            if packed is not None:
                return None, packed, None
        if self.fold:
            head_w, norm_w = head_w * norm_w, None
        return _cast(norm_w, self.cast), _transposed(head_w, head_cast, head=True), _cast(bias, head_cast)

    @torch.no_grad()
    def refresh(self, model: Any) -> None:
        """Copy ``model``'s current weights into this decoder's copies in place, one layer at a time (beside the
        decoder, one layer's copies at most), so that CUDA graphs captured over them (:mod:`rlflow.rollout.graphs`)
        stay valid. ``model`` is the one the decoder was built from, with its parameters where they were (the
        decoder reads its embedding table, and in its own dtype its norms' weights and biases, in place);
        afterwards the decoder computes what a new one would, bit for bit. Not for prepacked (CPU) decoders."""
        weights = [self.lm_head_w, *(w for layer in self.layers for w in vars(layer).values())]
        if any(isinstance(w, PackedWeight) for w in weights):
            raise ValueError("FusedDecoder.refresh: the matrices are prepacked; build a new decoder instead")
        model = unwrap_peft(model)
        for old, layer in zip(self.layers, model.model.layers):
            new = _Layer(layer, self.fold, self.cast)
            for name, value in vars(new).items():
                mine = getattr(old, name)
                if name == "qk_norm" and value is not None:
                    mine, value = mine[0], value[0]
                if isinstance(value, torch.Tensor) and mine is not value:
                    mine.copy_(value)
        for mine, value in zip((self.norm_w, self.lm_head_w, self.lm_head_b), self._head(model)):
            if value is not None and mine is not value:
                mine.copy_(value)

    def prepack(self, rows: int) -> None:
        """Pack the large weight matrices once in the CPU GEMM library's layout (:mod:`rlflow.rollout.prepack`),
        for decode steps of up to ``rows`` rows (MKL's float32 packs: packed again for more rows; oneDNN's and the
        row GEMM's fit every row count); a no-op where nothing packs. Results are bit-identical to the unpacked
        products where :func:`~rlflow.rollout.prepack.rounds_like_mm`; elsewhere (oneDNN's float32 kernel, the row
        GEMM) they differ from them by float rounding, and the engine packs the decoder before its first product, so
        that all of them round alike."""
        if self.packed_rows and (rows <= self.packed_rows or not self.packed_per_rows):
            return
        if self.embed.device.type != "cpu":
            return
        for layer in self.layers:
            layer.pack(rows)
        if self.dtype == torch.float32:
            self.lm_head_w = _packed(self.lm_head_w, self.lm_head_b, rows)
        elif not self.head_fp32:  # a packable 16-bit head is a physical transpose, whose mm may round unlike the packed
            self.lm_head_w = _packed(self.lm_head_w, self.lm_head_b, rows, checked=True)  # product: per row count
        self.packed_rows = rows
        # more rows: run unpacked (o and down are never MKL-packed: _packed keeps their addmm)
        self.packed_per_rows = any(isinstance(w, PackedWeight) and w.mkl for w in self.matrices())
        self.compiled_ops = self._compiled_ops_apply()

    def _compiled_ops_apply(self) -> bool:
        """Whether :mod:`rlflow.rollout.decode_ops` computes the operations around the products: a float32 decoder
        (folded norms) whose matrices the row GEMM packed (the two are one build: packed by it, they are loaded),
        with SiLU MLPs, a RoPE table and the model's norm formula (``norm: torch`` keeps ``F.rms_norm``)."""
        row_gemm = any(isinstance(w, PackedWeight) and w.kernel == "row_gemm" for w in self.matrices()[1:])
        return self.fold and self.rope_table and self.silu and self.rms_norm is _rms_norm and row_gemm

    def large_enough_to_pack(self) -> bool:
        """Whether any of the decoder's matrices has the size :mod:`rlflow.rollout.prepack` packs (a CPU's packing
        kernels, some built on first use, are looked up only for such decoders)."""
        return any(isinstance(w, PackedWeight) or isinstance(w, torch.Tensor) and large_enough(w)
                   for w in self.matrices())

    def matrices(self) -> list[torch.Tensor | PackedWeight]:
        """The LM head's matrix, then each layer's q/k/v, gate/up, o and down, as the decoder holds them."""
        return [self.lm_head_w] + [w for layer in self.layers for w in (layer.qkv_w, layer.gate_up_w, layer.o_w,
                                                                          layer.down_w)]

    def rope(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos``, ``sign * sin`` ``[rows, 1, dim]`` at ``positions``, from the table (grown by doubling as needed)."""
        half = self.head_dim // 2
        if not self.rope_table:
            cos, sin = self.rotary(h, positions[:, None])
            return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        cos, sin = self.rope_table_for(h, positions).index_select(0, positions).unsqueeze(1).unbind(2)  # one lookup
        return cos, sin

    def rope_table_for(self, h: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The table ``[positions, 2, dim]`` (cos, and sin with rotate_half's sign folded in), grown by doubling to
        hold ``positions``; ``h`` gives the rotary maths its dtype and device."""
        half = self.head_dim // 2
        need = int(positions.max()) + 1
        if self._table is None or self._table.shape[0] < need:
            length = max(need, 256, 0 if self._table is None else 2 * self._table.shape[0])
            cos, sin = self.rotary(h, torch.arange(length, device=h.device)[None])  # the model's own rotary maths
            sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
            self._table = torch.stack([cos[0], sin], dim=1)  # [positions, 2, dim]
        return self._table

    @staticmethod
    def unsupported_reason(model: Any) -> str | None:
        """Why ``model`` cannot be decoded by this class, or None when it can."""
        model = unwrap_peft(model)
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            return f"model type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
        if not isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
            return "the model has no plain nn.Linear lm_head"
        layout = FusedDecoder._layout_problem(model)
        if layout:
            return layout
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover - torch without distributed
            return None
        if any(isinstance(p, DTensor) for p in model.parameters()):
            return "the weights are sharded (DTensor); the model's own forward gathers them"
        return None

    @staticmethod
    def _layout_problem(model: Any) -> str | None:
        """What in ``model``'s modules this class would read wrongly: it reads the weights of plain ``nn.Linear``
        projections (plain ``nn.Linear``, or PEFT LoRA layers over them, whose deltas it folds into its copies)
        and RMSNorms directly, so another adapter or a quantised wrapper around them must not pass."""
        inner = getattr(model, "model", None)
        if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
            return "the model has no model.embed_tokens/layers/norm/rotary_emb"
        if not isinstance(inner.embed_tokens, torch.nn.Embedding):
            return f"the embeddings are a {type(inner.embed_tokens).__name__}, not a plain nn.Embedding"
        for layer in inner.layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
            linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
            if any(lin is None for lin in linears):
                return "a decoder layer lacks one of the q/k/v/o or gate/up/down projections"
            problem = next((p for p in map(fold_problem, linears) if p), None)
            if problem:
                return f"{problem} (adapters or quantisation)"
            norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
            if not all(hasattr(n, "weight") and hasattr(n, "variance_epsilon") for n in norms):
                return "a decoder layer's norms are not RMSNorms with weight and variance_epsilon"
        return None

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The residual stream ``[rows, hidden]`` of ``tokens`` (``[rows]``), in the decoder's dtype."""
        return F.embedding(tokens, self.embed).to(self.dtype)

    def attention_inputs(
        self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``layer``'s query ``[rows, heads, 1, dim]``, key and value ``[rows, kv_heads, 1, dim]`` (RoPE applied)
        from the residual stream ``h``: input norm, the q/k/v product, Qwen3's q/k norms, RoPE on q and k at once."""
        rows, heads, kv_heads, dim = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        x = self.rms_norm(h, layer.ln1_w, layer.ln1_eps)
        qkv = _linear(x, layer.qkv_w, layer.qkv_b)
        qk = qkv[:, : layer.q_size + layer.kv_size].view(rows, heads + kv_heads, dim)
        v = qkv[:, layer.q_size + layer.kv_size :].view(rows, kv_heads, 1, dim)
        if layer.qk_norm is not None:
            qk = self.rms_norm(qk, *layer.qk_norm)
        qk = torch.addcmul(qk * cos, qk.roll(dim // 2, -1), sin)[:, :, None]
        return qk[:, :heads], qk[:, heads:], v

    def after_attention(self, layer: _Layer, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The residual stream after ``layer``, from the one before it and its attention's output ``out``
        (``[rows, heads * dim]``): the o projection's residual, post-attention norm, the MLP's residual."""
        h = _residual(h, out, layer.o_w, layer.o_b)
        x = self.rms_norm(h, layer.ln2_w, layer.ln2_eps)
        gate, up = _linear(x, layer.gate_up_w, layer.gate_up_b).split(layer.inter, dim=-1)
        return _residual(h, layer.act(gate) * up, layer.down_w, layer.down_b)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of the last layer's residual stream: the final norm and the LM head."""
        h = self.rms_norm(h, self.norm_w, self.norm_eps)
        return _linear(h.float() if self.head_fp32 else h, self.lm_head_w, self.lm_head_b)

    def step(
        self, tokens: torch.Tensor, positions: torch.Tensor, attend, select: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of one decode step (or, with ``attend`` doing causal attention over many tokens
        of each prompt, of a prefill: every operation but attention acts on each token alone).

        Args:
            tokens: ``[rows]`` token fed at this step.
            positions: ``[rows]`` its position id.
            attend: ``attend(layer_idx, q, k, v, scaling) -> [rows, heads * head_dim]`` with ``q``
                ``[rows, heads, 1, dim]`` and ``k``/``v`` ``[rows, kv_heads, 1, dim]`` after RoPE: stores ``k``/``v``
                in the cache and attends.
            select: rows whose logits to return (all when None), e.g. the last token of each prompt of a prefill.
        """
        if self.compiled_ops:
            return self._compiled_step(tokens, positions, attend, select)
        h = self.embed_tokens(tokens)
        cos, sin = self.rope(h, positions)  # [rows, 1, dim]
        for idx, layer in enumerate(self.layers):
            q, k, v = self.attention_inputs(layer, h, cos, sin)
            h = self.after_attention(layer, h, attend(idx, q, k, v, layer.scaling))
        return self.logits(h if select is None else h[select])

    def _compiled_step(
        self, tokens: torch.Tensor, positions: torch.Tensor, attend, select: torch.Tensor | None
    ) -> torch.Tensor:
        """:meth:`step` with the operations around the products as :mod:`rlflow.rollout.decode_ops` calls (float32,
        folded norm weights): per layer the input norm, q/k/v, Qwen3's q/k norms, RoPE, attention, o, the
        post-attention norm, gate/up, SiLU * up, down."""
        h = self.embed_tokens(tokens)
        table = self.rope_table_for(h, positions)
        rows, heads, kv_heads, dim = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        for idx, layer in enumerate(self.layers):
            qkv = _linear(decode_ops.rms_norm(h, layer.ln1_eps), layer.qkv_w, layer.qkv_b)
            qk_end = layer.q_size + layer.kv_size
            rotated = qkv
            if layer.qk_norm is not None:
                weight, eps = layer.qk_norm
                rotated = decode_ops.rms_norm(qkv[:, :qk_end].reshape(-1, dim), eps, weight).view(rows, qk_end)
            qk = decode_ops.rope(rotated, table, positions, heads + kv_heads, dim)[:, :, None]
            v = qkv[:, qk_end:].view(rows, kv_heads, 1, dim)
            h = _residual(h, attend(idx, qk[:, :heads], qk[:, heads:], v, layer.scaling), layer.o_w, layer.o_b)
            gate_up = _linear(decode_ops.rms_norm(h, layer.ln2_eps), layer.gate_up_w, layer.gate_up_b)
            h = _residual(h, decode_ops.silu_mul(gate_up, layer.inter), layer.down_w, layer.down_b)
        h = decode_ops.rms_norm(h if select is None else h[select], self.norm_eps)
        return _linear(h, self.lm_head_w, self.lm_head_b)
