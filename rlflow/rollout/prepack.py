"""Prepacked weight matrices for the fused decoder's matrix products on a CPU (:mod:`rlflow.rollout.fused`).

Why: a decode step multiplies a few dozen rows by every weight matrix of the model, and a CPU GEMM library
(MKL for float32, oneDNN for bfloat16 ``mm``) first repacks the weight operand into its blocked layout on every
call. At these sizes that repacking is a good part of a step's matrix products (``benchmarks/bench_rollout.py``
shows the effect on a whole rollout). This module packs a matrix once per
:class:`~rlflow.rollout.fused.FusedDecoder` (whose weight copies are made once per set of weights anyway) with the
kernels torch's own CPU inference paths use:

* float32, on a CPU whose widest vector unit is AVX2 (most laptops and desktops; :func:`float32_kernel`): oneDNN's
  prepacked linear, as for bfloat16 below. There MKL's products of a few rows barely use a second core and
  oneDNN's use both (``benchmarks/bench_rollout.py --with-mkl`` compares the two). Its sums run in another order
  than ``torch.mm``'s, so its results differ from ``torch.mm``'s by float32 rounding (the same seed samples the
  same tokens, with log-probs equal to rounding). In exchange row ``i`` of a product has the same bits at every row
  count and thread count, which ``torch.mm`` does not promise: the engine packs such a decoder when it builds it,
  before its first prefill (:meth:`~rlflow.rollout.fused.FusedDecoder.prepack`), so that prefills and decode steps
  take the one kernel, and a rollout samples the same tokens and log-probs on one thread or two (the trainer and a
  generator process may run different thread counts). That row independence is checked once per matrix shape on
  a seeded input (:meth:`PackedWeight.rows_independent`); a shape that fails it takes MKL's kernel below.
* float32 on a CPU with AVX-512: rlflow's own row GEMM (:mod:`rlflow.rollout.row_gemm`), compiled on first use,
  which streams a matrix's panels from memory while it multiplies them; like oneDNN's kernel above it rounds unlike
  ``torch.mm`` and gives each row the same bits at every row count (checked the same way), and the engine packs
  the decoder before its first prefill. Where it cannot be built, MKL's below.
* float32 elsewhere: MKL's packed GEMM (``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``), packed for
  one row count; a product with fewer rows is padded with zero rows to it (row ``i`` of the result does not depend
  on the other rows), one with more rows runs unpacked ``torch.mm``. Its results must be bit-identical to
  ``torch.mm`` with the transposed weight, so that the engine samples the same tokens packed or not: on some CPUs
  ``torch.mm`` takes another kernel for a few rows and rounds differently, so each row count is checked once
  against ``torch.mm`` on a random input (:meth:`PackedWeight.agrees`) and a count that differs runs unpacked.
  Only products without a bias or residual are packed: MKL's ``addmm`` accumulates its addend inside the blocked
  sum, which a packed product followed by an add would round differently.
* bfloat16: oneDNN's prepacked linear (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``),
  usable for any row count, with the residual add as its ``add`` post-op; bit-identical to ``torch.mm`` /
  ``torch.addmm`` with the same weight as a transposed view of a ``[out, in]`` matrix (checked by the same test),
  which is how the decoder holds its 16-bit layer weights. Its 16-bit LM head is a physically transposed copy,
  whose ``mm`` takes another kernel path on some CPUs and rounds differently at some row counts (and on others
  repacks the whole head on every call, a large part of a step): it is packed ``checked``, so each row count's
  packed product is compared once with ``torch.mm`` on a random input (:meth:`PackedWeight.agrees`) and a count
  that differs runs unpacked. Only on CPUs with native bf16 (AMX or AVX512-BF16): where bf16 is emulated,
  ``torch.mm`` takes other kernels at some row counts (1 row; 333 rows on two threads, on a Xeon with AVX-512 but
  neither) and rounds unlike the packed product for some inputs; bf16 decoding is slower than float32 there
  anyway, and ``dtype: auto`` does not choose it.

Simplifications: CPU only, and only where torch was built with MKL or oneDNN (float32) or oneDNN (bfloat16); other
dtypes and devices keep ``torch.mm``. Matrices under :data:`MIN_NUMEL` entries stay unpacked (a small matrix
stays in cache, where packing saves nothing; the tiny demo model is all small matrices). A packed copy is extra
memory beside the decoder's own copy (MKL's float32 buffer is about twice the matrix's bytes), held as long as
the decoder, except the row GEMM's panels made straight from a model's weights (:meth:`PackedWeight.of_rows`),
which are the decoder's only copy. oneDNN's float32 kernel is chosen on AVX2 CPUs only, where it was measured;
MKL stays the float32 kernel on AVX-512 CPUs where rlflow's own cannot be built.
"""

from __future__ import annotations

import torch

from rlflow.rollout import row_gemm
from rlflow.rollout.hardware import native_bf16

MIN_NUMEL = 1 << 18  # entries of the smallest matrix worth packing (576 x 576 is 331,776)
#: ``(rows, packed rows, in, out)`` -> whether MKL's padded packed product equals ``torch.mm`` bit for bit here
_AGREES: dict[tuple[int, ...], bool] = {}
#: ``(kernel, in, out, oneDNN's packed row count)`` -> whether that float32 kernel's product of each row is the same at
#: every row count and thread count here
_ROWS_INDEPENDENT: dict[tuple[str, int, int, int | None], bool] = {}
#: Row counts :meth:`PackedWeight.rows_independent` compares with one product of all of them
PROBE_ROWS = (1, 2, 3, 7, 16, 33, 100)


def _onednn() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _mkl() -> bool:
    return bool(getattr(torch._C, "has_mkl", False)) and hasattr(torch.ops.mkl, "_mkl_linear")


def float32_kernel() -> str | None:
    """The kernel that multiplies packed float32 matrices on this CPU: ``"onednn"`` where torch's widest CPU
    capability is AVX2, ``"row_gemm"`` (:mod:`rlflow.rollout.row_gemm`) where it is AVX-512 and that kernel builds,
    else ``"mkl"`` (see the module docstring); None where none of them is there."""
    capability = torch.backends.cpu.get_cpu_capability()
    if _onednn() and capability == "AVX2":
        return "onednn"
    if "AVX512" in capability and row_gemm.available():
        return "row_gemm"
    return "mkl" if _mkl() else None


def packs(dtype: torch.dtype) -> bool:
    """Whether this module packs CPU matrices of ``dtype`` here (this torch has the kernels and, for bfloat16,
    the CPU multiplies it natively)."""
    if dtype == torch.float32:
        return float32_kernel() is not None
    if dtype == torch.bfloat16:
        return _onednn() and native_bf16(torch.device("cpu"))
    return False


def rounds_like_mm(dtype: torch.dtype) -> bool:
    """Whether packed products of ``dtype`` equal ``torch.mm``'s bit for bit (else they equal each other whatever
    the row count, and a decoder is packed before its first product: :meth:`~rlflow.rollout.fused.FusedDecoder.
    prepack`)."""
    return not (dtype == torch.float32 and float32_kernel() in ("onednn", "row_gemm"))


def products_in_words(dtype: torch.dtype) -> str | None:
    """What multiplies the packed ``dtype`` matrices of a decoder here, as the engine's start-up line says it (None
    where ``dtype`` does not pack on this CPU)."""
    if not packs(dtype):
        return None
    if dtype != torch.float32:
        return "oneDNN's packed bf16 products"
    return {"onednn": "oneDNN's packed float32 products", "row_gemm": "rlflow's row GEMM for float32 products",
            "mkl": "MKL's packed float32 products"}[float32_kernel()]


def large_enough(weight_t: torch.Tensor) -> bool:
    """Whether ``weight_t`` is a CPU matrix of the size this module packs (whatever its dtype and this CPU's
    kernels: asks no kernel, so builds none)."""
    return weight_t.device.type == "cpu" and weight_t.dim() == 2 and weight_t.numel() >= MIN_NUMEL


def packable(weight_t: torch.Tensor) -> bool:
    """Whether ``weight_t`` (``[in, out]``) is a CPU matrix this module packs (dtype, size, kernels present)."""
    return large_enough(weight_t) and packs(weight_t.dtype)


def _onednn_products(x: torch.Tensor, h: torch.Tensor, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """oneDNN's ``x @ W`` and ``h + x @ W`` with a packed ``W``."""
    return (torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
            torch.ops.mkldnn._linear_pointwise.binary(x, h, packed, None, "add"))


def _row_gemm_products(x: torch.Tensor, h: torch.Tensor, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The row GEMM's ``x @ W`` and ``h + x @ W`` with ``W``'s panels."""
    return row_gemm.mm(x, packed, h.shape[1]), row_gemm.mm(x, packed, h.shape[1], h)


#: The float32 kernels whose rows are checked to be independent of the row count, with their products
ROW_INDEPENDENT_KERNELS = {"onednn": _onednn_products, "row_gemm": _row_gemm_products}


def _pack_for(kernel: str, weight_t: torch.Tensor, rows: int) -> torch.Tensor:
    """``weight_t``'s copy in ``kernel``'s layout (``rows``: the row count oneDNN packs for)."""
    if kernel == "row_gemm":
        return row_gemm.pack(weight_t)
    return torch.ops.mkldnn._reorder_linear_weight(weight_t.t(), rows)


class PackedWeight:
    """A weight matrix (``[in, out]``, as the fused decoder stores it) with a copy in the CPU GEMM library's
    packed layout: ``x @ weight_t`` without repacking the weight on every call (see the module docstring)."""

    def __init__(self, weight_t: torch.Tensor, rows: int, checked: bool = False) -> None:
        """
        Args:
            weight_t: The matrix, ``[in, out]``; kept (the products it cannot pack use it).
            rows: Row count of the products to pack for (float32 only: its packing is for one row count).
            checked: bfloat16: use the packed product only for row counts where it equals ``torch.mm`` with
                ``weight_t`` (:meth:`agrees`; float32 products are always checked).
        """
        if not packable(weight_t):
            raise ValueError(f"PackedWeight: cannot pack a {weight_t.dtype} {tuple(weight_t.shape)} matrix on "
                             f"{weight_t.device} (float32 with MKL or oneDNN or bfloat16 with oneDNN, on a CPU)")
        self._weight_t = weight_t
        self.out_features = weight_t.shape[1]
        self.rows = rows
        fp32 = weight_t.dtype == torch.float32
        #: ``"onednn"`` (bfloat16, or float32 on AVX2), ``"row_gemm"`` (float32 on AVX-512) or ``"mkl"`` (float32
        #: elsewhere, or where the chosen kernel's rows would depend on the row count)
        self.kernel = float32_kernel() if fp32 else "onednn"
        if self.kernel in ROW_INDEPENDENT_KERNELS:
            self.packed = _pack_for(self.kernel, weight_t, rows)
            if fp32 and not self.rows_independent(weight_t, self.packed, self.kernel, rows):
                self.kernel = "mkl"
        self.mkl = self.kernel == "mkl"
        self.checked = checked or self.mkl
        if self.mkl:
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight_t.t().contiguous(), rows)

    @classmethod
    def of_rows(cls, pieces: list[torch.Tensor], col_scale: torch.Tensor | None, row_scales: list[float],
                rows: int) -> PackedWeight | None:
        """The float32 ``[in, out]`` matrix ``(torch.cat(pieces) * col_scale)`` with each piece's rows then times its
        row scale, transposed (``pieces``: ``[n_i, in]``, ``nn.Linear``'s layout), packed by the row GEMM straight
        from the pieces (:func:`rlflow.rollout.row_gemm.pack_rows`: one pass, and no ``[in, out]`` copy kept; it is
        made from the panels, bit for bit, if a product ever needs it): the panels the constructor makes of that
        matrix. None where the row GEMM is not the float32 kernel here, the pieces are not float32 CPU matrices
        with contiguous rows, the matrix is below :data:`MIN_NUMEL` entries, or its shape's rows would depend on
        the row count (:meth:`rows_independent`): the caller then makes the matrix with torch."""
        in_features, out = pieces[0].shape[-1], sum(p.shape[0] for p in pieces)
        if in_features * out < MIN_NUMEL or not all(
                p.device.type == "cpu" and p.dtype == torch.float32 and p.dim() == 2 and p.stride(1) == 1
                for p in pieces) or float32_kernel() != "row_gemm":
            return None
        packed = row_gemm.pack_rows(pieces, col_scale, row_scales)
        if not cls.rows_independent(torch.empty(in_features, out, device="meta"), packed, "row_gemm"):
            return None
        weight = cls.__new__(cls)
        weight._weight_t, weight.packed, weight.out_features, weight.rows = None, packed, out, rows
        weight.kernel, weight.mkl, weight.checked = "row_gemm", False, False
        return weight

    @property
    def weight_t(self) -> torch.Tensor:
        """The ``[in, out]`` matrix (for row GEMM panels made by :meth:`of_rows`: made from them, once, when asked)."""
        if self._weight_t is None:
            self._weight_t = row_gemm.unpack(self.packed, self.out_features)
        return self._weight_t

    @staticmethod
    def rows_independent(weight_t: torch.Tensor, packed: torch.Tensor | None = None, kernel: str = "onednn",
                         rows: int | None = None) -> bool:
        """Whether ``kernel``'s float32 product with a ``weight_t``-shaped matrix (``packed``: its copy in that
        kernel's layout, made here if None; oneDNN's packed for ``rows`` rows) gives each row the same bits at every
        row count of :data:`PROBE_ROWS` (with and without the residual add) and on one thread as on several, on a
        seeded input; checked once per kernel, shape and oneDNN's row count. (oneDNN's float32 products depend on
        the row count it packed for, and in some torch releases on the thread count.)"""
        most = max(PROBE_ROWS)
        rows = (rows or most) if kernel == "onednn" else None
        key = (kernel, *weight_t.shape, rows)
        if key not in _ROWS_INDEPENDENT:
            products = ROW_INDEPENDENT_KERNELS[kernel]
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(most, key[1], generator=gen)
            h = torch.randn(most, key[2], generator=gen)
            if packed is None:
                packed = _pack_for(kernel, weight_t, rows or most)
            full, full_add = products(x, h, packed)
            threads = torch.get_num_threads()
            try:
                same = True
                for n_threads in sorted({1, max(2, threads)}):
                    torch.set_num_threads(n_threads)
                    same = same and all(
                        torch.equal(got, full[:r]) and torch.equal(got_add, full_add[:r])
                        for r in PROBE_ROWS for got, got_add in [products(x[:r], h[:r], packed)])
            finally:
                torch.set_num_threads(threads)
            _ROWS_INDEPENDENT[key] = same
        return _ROWS_INDEPENDENT[key]

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight_t`` (``x`` ``[rows', in]``), bit-identical to ``torch.mm(x, weight_t)``
        except through oneDNN's float32 kernel or the row GEMM (there: to float32 rounding)."""
        rows = x.shape[0]
        if not self.mkl:
            if self.checked and not self.agrees(rows):
                return torch.mm(x, self.weight_t)
            return self._packed_mm(x)
        if rows > self.rows or x.dtype != torch.float32 or not self.agrees(rows):
            return torch.mm(x, self.weight_t)
        return self._mkl_mm(x)

    def _packed_mm(self, x: torch.Tensor) -> torch.Tensor:
        """The packed product: MKL's (padded to the packed row count), oneDNN's or the row GEMM's (any row count)."""
        if self.mkl:
            return self._mkl_mm(x)
        if self.kernel == "row_gemm":
            return row_gemm.mm(x, self.packed, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def _mkl_mm(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if rows < self.rows:  # zero rows to the packed count (each row's result depends on that row alone)
            padded = x.new_zeros((self.rows, x.shape[1]))
            padded[:rows] = x
            return torch.ops.mkl._mkl_linear(padded, self.packed, self.weight_t.t(), None, self.rows)[:rows]
        return torch.ops.mkl._mkl_linear(x.contiguous(), self.packed, self.weight_t.t(), None, self.rows)

    def agrees(self, rows: int) -> bool:
        """Whether the packed product of ``rows`` rows equals ``torch.mm`` bit for bit on this CPU, checked once per
        row count and matrix shape (for bfloat16 also per memory layout and thread count) on a seeded random input
        (``torch.mm`` may take another kernel for some row counts or layouts, which rounds differently)."""
        key = (rows, self.rows, *self.weight_t.shape)
        if not self.mkl:
            key = (self.weight_t.dtype, self.weight_t.stride(), torch.get_num_threads(), *key)
        if key not in _AGREES:
            x = torch.randn(rows, self.weight_t.shape[0], generator=torch.Generator().manual_seed(rows))
            x = x.to(self.weight_t.dtype)
            _AGREES[key] = torch.equal(self._packed_mm(x), torch.mm(x, self.weight_t))
        return _AGREES[key]

    def addmm(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``h + x @ weight_t``, bit-identical to ``torch.addmm(h, x, weight_t)`` (MKL: unpacked, see the module
        docstring), except through oneDNN's float32 kernel or the row GEMM (there: to ``h + self.mm(x)``)."""
        if self.mkl:
            return torch.addmm(h, x, self.weight_t)
        if self.kernel == "row_gemm":
            return row_gemm.mm(x, self.packed, self.out_features, h)
        return torch.ops.mkldnn._linear_pointwise.binary(x, h, self.packed, None, "add")
