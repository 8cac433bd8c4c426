"""The trainer ``rlflow fit`` builds: Lightning's ``Trainer`` with one more value for ``trainer.precision``.

``precision: auto`` computes in bf16 where the device multiplies bf16 in hardware and in float32 elsewhere:
``bf16-mixed`` (autocast: bf16 matrix products over float32 master weights) on a CUDA GPU with bf16 or a CPU
with AMX or AVX512-BF16, ``32-true`` on any other device, where bf16 products are emulated and several times slower
than float32 (:func:`rlflow.rollout.hardware.native_bf16`, the test the engine's ``dtype: auto`` makes). The value
it settles on is logged with the reason. Every other value is Lightning's, passed through unchanged.
"""

from __future__ import annotations

from typing import Literal

import torch
from lightning.fabric.connector import _PRECISION_INPUT
from lightning.pytorch import Trainer

from rlflow.log import info
from rlflow.rollout.hardware import native_bf16

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
    """``(precision, reason)`` for ``precision: auto`` on ``trainer.accelerator``: ``bf16-mixed`` where the device
    multiplies bf16 natively, ``32-true`` elsewhere."""
    device = compute_device(accelerator)
    if device is None:
        return "32-true", f"accelerator {accelerator!r}: bf16 support not checked there"
    if native_bf16(device):
        units = "bf16 support" if device.type == "cuda" else "AMX or AVX512-BF16"
        return "bf16-mixed", f"the {device.type.upper()} multiplies bf16 in hardware ({units})"
    if device.type == "cuda":
        return "32-true", "this GPU has no bf16 support"
    return "32-true", "this CPU has no AMX or AVX512-BF16: bf16 products would be emulated, slower than float32"


class RLFlowTrainer(Trainer):
    """Lightning's ``Trainer``; ``precision`` also takes ``auto`` (the module's docstring)."""

    def __init__(self, *args, precision: _PRECISION_INPUT | Literal["auto"] | None = None, **kwargs) -> None:
        """
        Args:
            precision: Lightning's precision (``32-true``, ``bf16-mixed``, ``16-mixed``, ...), or ``auto``:
                ``bf16-mixed`` where the device multiplies bf16 in hardware (a CUDA GPU with bf16, a CPU with AMX
                or AVX512-BF16), ``32-true`` elsewhere; the choice is logged.
        """
        if precision == AUTO:
            precision, reason = auto_precision(kwargs.get("accelerator", AUTO))
            info(f"trainer.precision=auto: {precision} ({reason})")
        super().__init__(*args, precision=precision, **kwargs)
