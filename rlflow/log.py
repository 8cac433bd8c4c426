"""rlflow's messages: one ``rlflow`` logger, written by the rank-zero process only.

Every rank runs the same code, so a plain ``print`` repeats each message once per rank. :func:`info` and
:func:`warn` go through Lightning's ``rank_zero_only`` (the rank is known once the strategy has set up, and read
from the launcher's environment before that) to the ``rlflow`` logger, which prints ``[rlflow] message`` lines
to standard output unless the application configured logging itself.

``rank_zero_only`` is imported from ``lightning_utilities``, where Lightning itself takes it (the same function
object, whose ``rank`` the strategy sets), and its rank is read from the environment as Lightning's import reads
it: a process that logs without training (the generator process, a judger's worker) does not import Lightning.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

from lightning_utilities.core.rank_zero import rank_zero_only

from rlflow.quiet import quiet_third_party


def _environment_rank() -> int:
    """The process's rank from the launcher's environment, read as ``lightning.fabric.utilities.rank_zero`` does
    (``LOCAL_RANK`` only after ``RANK``; 0 where none is set)."""
    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK"):
        if os.environ.get(key) is not None:
            return int(os.environ[key])
    return 0


# as Lightning's import does, without overwriting a rank the trainer has set
rank_zero_only.rank = getattr(rank_zero_only, "rank", _environment_rank())


class _StdoutHandler(logging.StreamHandler):
    """A handler that writes to ``sys.stdout`` as it is when a message is logged, not as it was when rlflow was
    imported (a notebook's or pytest's capture that has since closed would make every later message a logging
    error)."""

    @property
    def stream(self) -> Any:
        return sys.stdout

    @stream.setter
    def stream(self, value: Any) -> None:  # StreamHandler.__init__ sets it; the property reads sys.stdout instead
        pass


logger = logging.getLogger("rlflow")
if not logger.handlers:
    _handler = _StdoutHandler()
    _handler.setFormatter(logging.Formatter("[rlflow] %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)

quiet_third_party()  # torchao's and torch pytree's import-time noise (rlflow/quiet.py)


@rank_zero_only
def info(message: str) -> None:
    """Log ``message`` at INFO level, on rank zero."""
    logger.info(message)


@rank_zero_only
def warn(message: str) -> None:
    """Log ``message`` at WARNING level, on rank zero."""
    logger.warning(message)
