"""The trainer ``rlflow fit`` builds: Lightning's ``Trainer`` with one more value for ``trainer.precision``.

``precision: auto`` computes in bf16 where that is faster than float32 on the device and in float32 elsewhere:
``bf16-mixed`` (autocast: bf16 matrix products over float32 master weights) on a CUDA GPU with bf16 or a CPU whose
bf16 units multiply at least 1.5x as fast as float32 (AMX), ``32-true`` on any other device: where bf16 products are
emulated, or where the CPU's bf16 units are slower than its float32 ones (AVX512-BF16 without AMX, measured)
(:func:`rlflow.rollout.hardware.bf16_faster`, the test the engine's ``dtype: auto`` makes). The value it settles
on is logged with the reason. Every other value is Lightning's, passed through unchanged.
"""

from __future__ import annotations

from typing import Literal

import torch
from lightning.fabric.connector import _PRECISION_INPUT
from lightning.pytorch import Trainer

from rlflow.log import info
from rlflow.rollout.hardware import BF16_MARGIN, bf16_faster, cpu_bf16_speedup, native_bf16

AUTO = "auto"


def compute_device(accelerator: object) -> torch.device | None:
    """The device type ``trainer.accelerator`` trains on (``auto`` picks CUDA, else Apple's MPS, where available,
    as Lightning does), or None for an accelerator other than the CPU and CUDA (``mps``, ``tpu``, an object)."""
    name = str(accelerator).lower() if isinstance(accelerator, str) else None
    if name == AUTO:
        mps = getattr(torch.backends, "mps", None)
        name = "cuda" if torch.cuda.is_available() else "mps" if mps is not None and mps.is_available() else "cpu"
    if name in ("gpu", "cuda"):
        return torch.device("cuda")
    return torch.device("cpu") if name == "cpu" else None


def auto_precision(accelerator: object = AUTO) -> tuple[str, str]:
    """``(precision, reason)`` for ``precision: auto`` on ``trainer.accelerator``: ``bf16-mixed`` where bf16 is
    faster than float32 there, ``32-true`` elsewhere."""
    device = compute_device(accelerator)
    if device is None:
        return "32-true", f"accelerator {accelerator!r}: bf16 support not checked there"
    if bf16_faster(device):
        units = "bf16 support" if device.type == "cuda" else \
            f"bf16 units, its bf16 products {cpu_bf16_speedup():.1f}x as fast as float32's"
        return "bf16-mixed", f"the {device.type.upper()} multiplies bf16 in hardware ({units})"
    if device.type == "cuda":
        return "32-true", "this GPU has no bf16 support"
    if native_bf16(device):
        return "32-true", (f"this CPU's bf16 products run {cpu_bf16_speedup():.2f}x as fast as float32's (less than "
                           f"{BF16_MARGIN:g}x)")
    return "32-true", "this CPU has no AMX or AVX512-BF16: bf16 products would be emulated, slower than float32"


class RLFlowTrainer(Trainer):
    """Lightning's ``Trainer``; ``precision`` also takes ``auto`` (the module's docstring)."""

    def __init__(self, *args, precision: _PRECISION_INPUT | Literal["auto"] | None = None, **kwargs) -> None:
        """
        Args:
            precision: Lightning's precision (``32-true``, ``bf16-mixed``, ``16-mixed``, ...), or ``auto``:
                ``bf16-mixed`` where bf16 is faster than float32 (a CUDA GPU with bf16, a CPU whose bf16 products
                measure >= 1.5x float32's), ``32-true`` elsewhere; the choice is logged with the reason.
        """
        if precision == AUTO:
            precision, reason = auto_precision(kwargs.get("accelerator", AUTO))
            info(f"trainer.precision=auto: {precision} ({reason})")
        super().__init__(*args, precision=precision, **kwargs)
