"""Third-party log messages that every run would print and that say nothing about it, silenced in one place.

torchao (the ``adamw_bf16_sr`` optimizer; transformers imports it whenever it is installed) logs at import that
its CUDA kernels do not load on a CPU build of torch, and torch's pytree logs a deprecation about torchao's enums.
Errors still show. Standard library only, so that the pipelined generator process (:mod:`rlflow.rollout.worker`)
applies it before its first import of transformers, as the trainer does through :mod:`rlflow.log`.
"""

from __future__ import annotations

import logging

NOISY_LOGGERS = ("torchao", "torch.utils._pytree")


def quiet_third_party() -> None:
    """Raise the level of :data:`NOISY_LOGGERS` to ERROR."""
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
