"""rlflow's own float32 matrix product for decode steps on AVX-512 CPUs (``csrc/row_gemm.cpp``).

Why: a decode step multiplies a few rows (one per sequence being decoded) by every weight matrix, so each weight is
read from memory once and used a few times: the step is bound by memory bandwidth. MKL's and oneDNN's products of
a few rows alternate between waiting for a block of the weights and multiplying it, so they stream the weights
well below the bandwidth a one-row product reaches. This kernel stores each matrix as panels of 16
columns (one contiguous stream per panel) and prefetches a few KiB ahead while it multiplies, so the stream and the
products overlap (``benchmarks/bench_row_gemm.py`` compares it with MKL's and oneDNN's packed products).

Its results differ from ``torch.mm``'s by float32 rounding (another order of the sums), and in exchange row ``i``
has the same bits at every row count and thread count: :mod:`rlflow.rollout.prepack` uses it as it uses oneDNN's
float32 kernel on AVX2 CPUs (the engine packs a decoder before its first product, so prefills and decode steps
round alike).

It is compiled from source the first time it is needed, by ``torch.utils.cpp_extension`` (a C++ compiler and
``ninja``; about 30 s on 2 cores), into torch's extension cache (``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``; one build per Python environment and torch version), and loaded from there
afterwards. Where it cannot be built (no compiler or ``ninja``: the reason is logged once) or the CPU lacks
AVX-512, the products stay MKL's. ``RLFLOW_ROW_GEMM=0`` keeps MKL's without trying. The same build holds the
compiled operations around a decode step's products (:mod:`rlflow.rollout.decode_ops`, ``csrc/decode_ops.cpp``),
used where this kernel packs the decoder: switched off with it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

#: The extension's sources: the row GEMM, and the fused operations around a decode step's products
#: (:mod:`rlflow.rollout.decode_ops`), which ride on the same build
SOURCES = [Path(__file__).with_name("csrc") / name for name in ("row_gemm.cpp", "decode_ops.cpp")]
#: Compiler flags: optimised, AVX-512 foundation instructions, OpenMP for ``at::parallel_for``'s threads, and no
#: contraction of a product and a sum into one rounding (the element-wise operations round as torch's do)
CFLAGS = ["-O3", "-mavx512f", "-fopenmp", "-ffp-contract=off"]
_LOADING = threading.Lock()  # one build or import at a time in a process (torch's file lock guards other processes)
_LOADED: list = []  # [the module, or None], once tried
#: A build lock this old is taken to be a killed build's: removed rather than waited on (a build takes ~30 s)
STALE_LOCK_SECONDS = 300.0


def extension_name() -> str:
    """The build's name in torch's extension cache: one per source, flags, torch version and Python environment, so
    that two environments on one machine do not rebuild each other's (torch keys a build by its name)."""
    key = b"\0".join([*(source.read_bytes() for source in SOURCES), " ".join(CFLAGS).encode(),
                      torch.__version__.encode(), sys.prefix.encode()])
    return f"rlflow_row_gemm_{hashlib.sha256(key).hexdigest()[:12]}"


def _build_directory(name: str) -> Path | None:
    """torch's build directory for ``name`` (None where that cannot be told: a private helper of torch's)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(name, False))
    except Exception:
        return None


def _wait_for_lock(name: str, poll: float = 0.5) -> None:
    """Wait while another process builds ``name`` (torch's ``lock`` file in its build directory); a lock older than
    :data:`STALE_LOCK_SECONDS` is a killed build's, which torch would wait on forever: removed, with a warning."""
    directory = _build_directory(name)
    lock = directory / "lock" if directory is not None else None
    while lock is not None and lock.exists():
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:  # released between the two calls
            return
        if age > STALE_LOCK_SECONDS:
            lock.unlink(missing_ok=True)
            log.warning("rlflow: removed the row GEMM's build lock %s, left %.0f s ago by a build that did not "
                        "finish", lock, age)
            return
        time.sleep(poll)


def _built(name: str) -> bool:
    """Whether a build of the kernel is in torch's extension cache (False where that cannot be told)."""
    directory = _build_directory(name)
    return directory is not None and (directory / f"{name}.so").exists()


def unsupported_reason() -> str | None:
    """Why this kernel is not tried here (None: it is): switched off, or a CPU without AVX-512."""
    if os.environ.get("RLFLOW_ROW_GEMM", "1").strip().lower() in ("0", "false", "off", "no"):
        return "RLFLOW_ROW_GEMM=0"
    capability = torch.backends.cpu.get_cpu_capability()
    if "AVX512" not in capability:
        return f"the CPU's widest vector unit is {capability}, not AVX-512"
    return None


def load() -> Any | None:
    """The compiled module (``pack``, ``pack_rows``, ``unpack``, ``mm``), built on first use; None where unsupported
    or the build fails (the reason logged once)."""
    if not _LOADED:
        with _LOADING:
            if not _LOADED:
                _LOADED.append(_build())
    return _LOADED[0]


def _build() -> Any | None:
    """Build (or load from torch's extension cache) the module; None where unsupported or the build fails."""
    reason = unsupported_reason()
    if reason is not None:
        return None
    try:
        from torch.utils import cpp_extension

        name = extension_name()
        _wait_for_lock(name)
        if not _built(name):
            log.info("rlflow: compiling the row GEMM kernel (once per machine and environment, about 30 s)")
        sources = [str(source) for source in SOURCES]
        return cpp_extension.load(name=name, sources=sources, extra_cflags=CFLAGS, verbose=False)
    except Exception as exc:  # no compiler, no ninja, a failed build: MKL's products instead
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        log.warning("rlflow: the row GEMM kernel could not be built (%s: %s); float32 decode products use MKL's "
                    "kernel", type(exc).__name__, first[:200])
        return None


def available() -> bool:
    """Whether the kernel runs here (built now if not yet)."""
    return load() is not None


def pack(weight_t: torch.Tensor) -> torch.Tensor:
    """``weight_t`` (``[in, out]`` float32) as the kernel's panels ``[ceil(out / 16), in, 16]``."""
    return load().pack(weight_t)


def pack_rows(pieces: list[torch.Tensor], col_scale: torch.Tensor | None = None,
              row_scales: list[float] | None = None) -> torch.Tensor:
    """The panels :func:`pack` makes of ``(torch.cat(pieces) * col_scale)``, each piece's rows then times its row
    scale, transposed to ``[in, out]`` (``pieces``: float32 ``[n_i, in]`` matrices, ``nn.Linear``'s layout): the
    same bits, in one pass over the pieces instead of a concatenation, a product, a transposing copy and the
    packing. ``col_scale`` None and a row scale of 1 multiply nothing."""
    scales = [1.0] * len(pieces) if row_scales is None else [float(s) for s in row_scales]
    return load().pack_rows(list(pieces), col_scale, scales)


def unpack(packed: torch.Tensor, out: int) -> torch.Tensor:
    """The ``[in, out]`` matrix whose panels ``packed`` holds (:func:`pack`'s inverse, bit for bit)."""
    return load().unpack(packed, out)


def mm(x: torch.Tensor, packed: torch.Tensor, out: int, add: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W`` (``+ add``, one float32 add after the product) with ``W``'s panels ``packed`` and ``out`` columns."""
    return load().mm(x, packed, out, add)
