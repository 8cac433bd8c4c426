"""What the device computes natively: whether bf16 matrix products run on bf16 units or are emulated.

Its own module because both the engine (``dtype: auto``) and the CPU weight packing (:mod:`rlflow.rollout.prepack`)
ask, and the engine imports the packing.
"""

from __future__ import annotations

import torch


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
