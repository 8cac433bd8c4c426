"""Third-party log messages that every run would print and that say nothing about it, silenced in one place.

torchao (the ``adamw_bf16_sr`` optimizer; transformers imports it whenever it is installed) logs at import that
its CUDA kernels do not load on a CPU build of torch, and torch's pytree logs a deprecation about torchao's enums.
Lightning logs a "💡 Tip" for its hosted services (litlogger, litmodels) at every ``Trainer`` set-up. Errors still
show. Standard library only, so that the pipelined generator process (:mod:`rlflow.rollout.worker`)
applies it before its first import of transformers, as the trainer does through :mod:`rlflow.log`.
"""

from __future__ import annotations

import logging

NOISY_LOGGERS = ("torchao", "torch.utils._pytree")
#: Lightning's rank-zero loggers (``rank_zero_info`` logs through one of them) and the prefix of its service tips.
LIGHTNING_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")
TIP_PREFIX = "\N{ELECTRIC LIGHT BULB} Tip:"


def _not_a_tip(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(TIP_PREFIX)


def quiet_third_party() -> None:
    """Raise the level of :data:`NOISY_LOGGERS` to ERROR and drop Lightning's service tips (idempotent)."""
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for name in LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        if _not_a_tip not in logger.filters:
            logger.addFilter(_not_a_tip)
