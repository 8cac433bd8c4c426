"""Large CPU tensors reuse the process's freed memory instead of fresh pages from the system.

glibc's ``malloc`` serves every block over its mmap threshold (32 MiB at most) with a fresh ``mmap`` and gives it
back with ``munmap`` when the block is freed. A training step on a CPU allocates such blocks again and again (a
chunk's logits and their gradient, the weights' 16-bit casts under ``bf16-mixed``, the tied embedding's gradient),
and every new one is faulted in page by page, each page zeroed by the kernel: for the tensors of a SmolLM2 step
that costs more than the operators that fill them (a cast of a ``[768, 49152]`` float32 tensor takes several times
as long in fresh pages as in reused ones).

:func:`reuse_freed_memory` makes glibc keep such blocks in its heap (``mallopt``: no mmap'd blocks, no trimming of
the heap's top below 2 GiB), so a freed block is reused by the next allocation of that size, already faulted in. It
changes the process for its remaining life (the allocator settings are process-wide): its resident memory stays
near its peak instead of shrinking between steps. ``model.update.reuse_freed_memory`` chooses it; by default it is
on where the policy trains on a CPU, off on accelerators (whose tensors do not come from ``malloc``, while a
loaded checkpoint's host copy would stay resident).

Simplifications: glibc on Linux only (elsewhere, or without ``mallopt``, nothing changes and it says so by
returning False); it does not undo itself; other allocators preloaded in the process (jemalloc, tcmalloc) are left
alone, since ``mallopt`` then reaches glibc's unused one.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

import torch

#: ``mallopt`` parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
#: free memory at the heap's top that glibc keeps rather than returning it (its largest accepted value)
TRIM_THRESHOLD = 2**31 - 1


def wanted(choice: bool | None, device: torch.device) -> bool:
    """Whether ``model.update.reuse_freed_memory`` (``choice``; None: by device) asks for it on ``device``."""
    return device.type == "cpu" if choice is None else bool(choice)


def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc with ``mallopt``, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") else None


def reuse_freed_memory(choice: bool | None, device: torch.device) -> bool:
    """Keep freed large blocks in the heap for reuse (see the module docstring) when ``choice`` asks for it on
    ``device``; True when the allocator now does."""
    if not wanted(choice, device):
        return False
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def release_free_memory() -> bool:
    """Give the free memory of the process's heap back to the system (glibc's ``malloc_trim``), for a process that
    goes idle after holding large temporaries; False where the C library is not glibc or nothing was returned."""
    libc = _glibc()
    return libc is not None and hasattr(libc, "malloc_trim") and bool(libc.malloc_trim(0))
