"""The float32 operations around a decode step's matrix products, one compiled call each (``csrc/decode_ops.cpp``).

Why: at decode sizes (a few rows, one per sequence) a torch operator costs more in dispatch and allocation than in
arithmetic. A layer of the fused decoder written in torch operators takes some 30 of them (the RMS norm's five,
RoPE's three, the cache write, the attention's reshapes, two batched products, mask adds and softmax, SiLU and its
product); these four calls replace them: :func:`rms_norm`, :func:`rope`, :func:`silu_mul` and :func:`attend` (which
writes the step's keys and values into the :class:`~rlflow.rollout.decode_state.DecodeState` caches and attends in
one pass, skipping the columns a row does not see).

They are built with the row GEMM (:mod:`rlflow.rollout.row_gemm`, the same extension) and used where it is: the
fused decoder turns them on for a float32 decoder whose matrices the row GEMM packed (:meth:`FusedDecoder.prepack
<rlflow.rollout.fused.FusedDecoder.prepack>`), so every CPU without AVX-512, every 16-bit decoder and every GPU keeps
torch's operators. RoPE gives torch's bits (the same roundings); SiLU times up uses torch's own exponential and
agrees with torch's to an ulp; the RMS norm's sum of squares and the attention's dot products and softmax add in
another order (float32 rounding). Each
row's result is one thread's, in one order, whatever the row count or thread count, as the row GEMM's is.
"""

from __future__ import annotations

import torch

from rlflow.rollout import row_gemm


def available() -> bool:
    """Whether the compiled operations run here (they are built with the row GEMM)."""
    return row_gemm.available()


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """``x * rsqrt(mean(x^2, -1) + eps)`` over the last dimension (then times ``weight``, ``[dim]`` or one row per
    head ``[heads, dim]`` for ``x`` ``[..., heads, dim]``), float32; the result is contiguous, shaped as ``x``."""
    flat = x.reshape(-1, x.shape[-1])
    return row_gemm.load().rms_norm(flat, eps, weight).view(x.shape)


def rope(qkv: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """The first ``heads`` heads of each row of ``qkv`` (``[rows, >= heads * dim]``) rotated at the row's position:
    ``x * cos + roll(x, dim / 2) * sin`` from ``table`` (``[positions, 2, dim]``: cos, then sin with rotate_half's
    sign folded in). Returns ``[rows, heads, dim]``."""
    return row_gemm.load().rope(qkv, table, positions, heads, dim)


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up`` ``[rows, 2 * inter]`` (gate first), ``[rows, inter]``."""
    return row_gemm.load().silu_mul(gate_up, inter)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, start: int,
    bias: torch.Tensor, step_bias: torch.Tensor | None, width: int, n: int, scale: float,
) -> torch.Tensor:
    """A decode step's attention in :class:`~rlflow.rollout.decode_state.DecodeState`'s layout: with ``start >= 0``
    the step's ``k``/``v`` (``[rows, kv_heads, dim]``) written at columns ``start + s`` of each group's caches
    (``[groups, kv_heads, columns, dim]``) first; then each query (``q`` ``[rows, heads, dim]``) against its group's
    first ``width`` columns, scores times ``scale`` plus ``bias`` ``[groups, n, >= width]`` (and ``step_bias``
    ``[groups, >= width]``), softmax, values. Returns ``[rows, heads * dim]``."""
    return row_gemm.load().attend(q, k, v, cache_k, cache_v, start, bias, step_bias, width, n, scale)
