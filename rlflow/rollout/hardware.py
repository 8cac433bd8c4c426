"""What the device and the runtime support: whether bf16 matrix products run on bf16 units or are emulated, and
whether they are faster than float32's there, whether decoding may run in ``torch.inference_mode``, and which
attention kernels suit decoding's changing shapes.

Its own module because both the engine (``dtype: auto``) and the CPU weight packing (:mod:`rlflow.rollout.prepack`)
ask, and the engine imports the packing.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

#: How much faster than float32 a CPU's bf16 matrix products must measure for ``auto`` settings to pick bf16
BF16_MARGIN = 1.5


def bf16_faster(device: torch.device) -> bool:
    """Whether computing in bfloat16 on ``device`` is faster than in float32, what ``auto`` settings pick bf16 by
    (the engine's ``dtype: auto``, ``trainer.precision: auto``): a CUDA GPU with bf16; a CPU with bf16 units
    (:func:`native_bf16`) whose bf16 matrix products measure at least :data:`BF16_MARGIN` times float32's
    (:func:`cpu_bf16_speedup`). bf16 units alone do not settle it: with AMX bf16 products run ~6x float32's, while on
    a Xeon with AVX512-BF16 and no AMX they ran at 0.52x (168 against 321 GFLOP/s), where a SmolLM2 training step
    took 1.7x as long in ``bf16-mixed`` as in float32. The margin keeps a borderline CPU on float32 run after run."""
    if not native_bf16(device):
        return False
    return device.type != "cpu" or cpu_bf16_speedup() >= BF16_MARGIN


@functools.cache
def cpu_bf16_speedup() -> float:
    """bf16 over float32 throughput of a ``[512, 1024] x [1024, 1024]`` matrix product on this CPU, at torch's
    thread count (best of 3 after a warm-up each; ~0.1 s), measured once per process. Its operands come from a
    generator of its own: torch's global one, which seeds a run's sampling, is not drawn from."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(512, 1024, generator=gen), torch.randn(1024, 1024, generator=gen)

    def best(x: torch.Tensor, y: torch.Tensor) -> float:
        torch.mm(x, y)
        times = []
        for _ in range(3):
            start = time.perf_counter()
            torch.mm(x, y)
            times.append(time.perf_counter() - start)
        return min(times)

    return best(a, b) / best(a.bfloat16(), b.bfloat16())


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices in hardware (a CUDA GPU with bf16; a CPU with AMX tiles or
    AVX512-BF16, which oneDNN uses for bf16 ``mm``), i.e. whether bf16 decoding is faster there, not only smaller."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        cpu = getattr(torch, "cpu", None)
        checks = [getattr(cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
        return any(check() for check in checks if check is not None)
    return False


def inference_context(model: torch.nn.Module | None = None) -> Any:
    """``torch.inference_mode()``: no autograd view or version-counter tracking, which a small model's decode step
    on a CPU, where per-operator cost dominates, would otherwise pay on every operator. ``torch.no_grad()``
    instead under a gloo process group, whose worker threads do not carry inference mode into the tensors they
    write (pytorch/pytorch#86830; Lightning's evaluation makes the same exception), and for a ``model`` with
    FSDP-sharded modules, whose unsharded weights and hooks are left to the mode FSDP2 is tested in. Tensors made
    inside cannot be saved for a backward pass, so it suits code whose results leave as numbers (the engine's
    token ids and log-probs)."""
    from rlflow.training.fsdp_units import fsdp_modules

    gloo = dist.is_available() and dist.is_initialized() and dist.get_backend() == "gloo"
    sharded = model is not None and bool(fsdp_modules(model))
    return torch.no_grad() if gloo or sharded else torch.inference_mode()


@contextmanager
def without_cudnn_attention(device: torch.device) -> Iterator[None]:
    """Inside, ``scaled_dot_product_attention`` on a CUDA ``device`` takes any kernel but cuDNN's (flash, or the
    memory-efficient one where a mask is given). cuDNN builds an execution plan for every new shape of its inputs
    and caches it, tens to hundreds of milliseconds per plan, and the engine's shapes are new all the time: a decode
    step's key width grows at every step, a prefill's width changes with every batch of prompts.

    ``torch.backends.cuda.enable_cudnn_sdp`` is process-wide: it is switched off on entry, where it was on, and back
    on at exit. Another thread's attention meanwhile (training beside pipelined rollouts) takes the other kernels
    too; only the choice of kernel changes, never a result beyond rounding. Elsewhere nothing changes."""
    if device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        yield
        return
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
