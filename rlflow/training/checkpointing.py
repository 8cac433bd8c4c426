"""Checkpoints that survive a ``kill -9`` or a full disk, and the RNG state that makes resuming exact.

* :class:`AtomicCheckpointIO` writes a checkpoint to a hidden temporary file in the target directory, flushes it
  to disk and renames it over the target (``os.replace`` is atomic on POSIX), so a kill during a save leaves the
  previous ``last.ckpt`` untouched. A full disk (``ENOSPC``/``EDQUOT``) removes the partial file and raises one
  :class:`CheckpointDiskFullError` that says what to free; nothing already written is lost.
* :class:`RLFlowCheckpoint` is Lightning's ``ModelCheckpoint`` with rlflow's defaults (``last.ckpt`` after every
  rollout step; ``every_n_train_steps`` and the ``step`` of the file names count rollout steps, see
  :mod:`rlflow.training.step_unit`), the atomic writer installed, ``--ckpt_path last`` that also finds the ``last.ckpt``
  of the previous run of the same logger directory (a resumed run gets a new ``version_N``), and a
  ``last.ckpt`` of the final step written like every step checkpoint, so a finished run continues exactly when
  ``max_steps`` is raised.
* :func:`capture_rng_state` / :func:`restore_rng_state`: the Python, NumPy and torch (CPU and CUDA) generators,
  one set per rank; :mod:`rlflow.training.resume` puts every rank's into the checkpoint and restores them when
  training starts again.

Simplifications: local file systems only get the atomic write (remote URLs use Lightning's writer); the partial
files of a killed process are removed the next time a run sets up the same checkpoint directory.
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint

PARTIAL_PREFIX = ".partial-"
DISK_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


class CheckpointDiskFullError(OSError):
    """The disk filled up while a checkpoint was written; the checkpoints already on disk are intact."""


def _is_local(path: str | os.PathLike) -> bool:
    text = str(path)
    return "://" not in text or text.startswith("file://")


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some file systems do not open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` through a temporary file in the same directory and an atomic rename."""
    path = Path(str(path).removeprefix("file://"))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f"{PARTIAL_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        written = tmp.stat().st_size if tmp.exists() else 0
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            free = shutil.disk_usage(path.parent).free
            raise CheckpointDiskFullError(
                exc.errno,
                f"no space left on the device while writing the checkpoint {path} (failed after {written / 2**20:.1f} "
                f"MiB; {free / 2**20:.1f} MiB free in {path.parent}). The checkpoints already in {path.parent} are "
                "intact. Free disk space or point --checkpoint.dirpath at a larger disk, then continue with "
                "--ckpt_path last",
            ) from exc
        raise
    _fsync_dir(path.parent)


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves are atomic: a kill or a full disk never leaves a broken checkpoint."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not _is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_torch_save(checkpoint, path)


def remove_stale_partials(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporary files that processes no longer running left behind in ``directory``."""
    removed = []
    directory = Path(directory)
    if not directory.is_dir():
        return removed
    for tmp in directory.glob(f"{PARTIAL_PREFIX}*.tmp"):
        match = re.match(rf"{re.escape(PARTIAL_PREFIX)}(\d+)-", tmp.name)
        pid = int(match.group(1)) if match else -1
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, 0)
            alive = pid > 0
        except (ProcessLookupError, OverflowError, ValueError):
            alive = False
        except PermissionError:
            alive = True
        if not alive:
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


class RLFlowCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint`` with atomic writes, rlflow's defaults and a ``last`` that survives a new log version.

    Every argument is Lightning's ``ModelCheckpoint`` argument; only the defaults differ: ``save_last=True`` and
    ``every_n_train_steps=1`` (one rollout step is minutes of generation, so a checkpoint per step is cheap by
    comparison). As in Lightning, ``save_top_k=1`` also keeps the newest ``epoch=E-step=S.ckpt``; ``save_top_k=0``
    writes only ``last.ckpt`` (half the checkpoint I/O), ``-1`` keeps every step.
    """

    def __init__(
        self,
        dirpath: str | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        save_last: bool | str | None = True,
        save_top_k: int = 1,
        mode: str = "min",
        every_n_train_steps: int | None = 1,
        every_n_epochs: int | None = None,
        save_weights_only: bool = False,
        verbose: bool = False,
    ) -> None:
        """
        Args:
            dirpath: Directory of the checkpoints; default ``<log_dir>/checkpoints``.
            filename: Name pattern of the top-k checkpoints (Lightning's ``epoch={epoch}-step={step}`` by default).
            monitor: Metric that ranks the top-k checkpoints (e.g. ``eval/accuracy``); None keeps the newest.
            save_last: Write ``last.ckpt`` (what ``--ckpt_path last`` resumes from).
            save_top_k: How many step-named checkpoints to keep besides ``last.ckpt``; 0 keeps none, -1 keeps all.
            mode: ``max`` or ``min``: whether a larger or a smaller ``monitor`` value is better.
            every_n_train_steps: Save after every this many rollout steps (0 disables step-based saving).
            every_n_epochs: Save after every this many epochs as well.
            save_weights_only: Save only the weights (such a checkpoint cannot resume a run).
            verbose: Log every save.
        """
        super().__init__(
            dirpath=dirpath, filename=filename, monitor=monitor, save_last=save_last, save_top_k=save_top_k,
            mode=mode, every_n_train_steps=every_n_train_steps, every_n_epochs=every_n_epochs,
            save_weights_only=save_weights_only, verbose=verbose,
        )

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if trainer.is_global_zero and self.dirpath and _is_local(self.dirpath):
            remove_stale_partials(self.dirpath)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Lightning warns on every save of a manually optimised module that the checkpoint holds the weights
        # *after* the optimizer step: that is exactly what a resume needs here.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            if self.save_last and _run_ends_here(trainer) and not self._should_skip_saving_checkpoint(trainer) \
                    and not self._defer_save_until_validation:
                self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A resumed run logs to a new version directory; Lightning's warning about it is expected, not a problem.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The dirpath has changed")
            super().load_state_dict(state_dict)

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        """Lightning's candidates plus the ``last*.ckpt`` of the other versions of the same logger directory."""
        found = set(super()._find_last_checkpoints(trainer))
        if self.dirpath is None and trainer.loggers:
            logger = trainer.loggers[0]
            root = Path(logger.save_dir or trainer.default_root_dir) / str(logger.name)
            pattern = re.compile(rf"^{re.escape(self.CHECKPOINT_NAME_LAST)}(-\d+)?{re.escape(self.FILE_EXTENSION)}$")
            if root.is_dir():
                found |= {os.path.normpath(p) for p in root.glob("*/checkpoints/*") if pattern.match(p.name)}
        return found


def _run_ends_here(trainer: Any) -> bool:
    """Whether ``fit`` stops after the current rollout step (``max_steps`` reached, or a callback stopped it).

    The last checkpoint of such a run must be written now, in ``on_train_batch_end``, like every step checkpoint:
    Lightning's own end-of-run save (``on_train_end``, for a final step that ``every_n_train_steps`` skips) comes
    after the loops have closed the epoch, so ``--ckpt_path last`` with a larger ``max_steps`` would start a new
    epoch and throw away the sampler's place in the unfinished one.
    """
    if trainer.max_steps is not None and 0 <= trainer.max_steps <= trainer.global_step:
        return True
    return bool(trainer.should_stop) and trainer.fit_loop._can_stop_early


# ------------------------------------------------------------------------------------------------ RNG state
def capture_rng_state() -> dict[str, Any]:
    """This process's Python, NumPy and torch (CPU and every CUDA device) generator states."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {  # plain types and tensors only: torch.load(weights_only=True) reads them
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the generators back to a :func:`capture_rng_state` result."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])


def gather_rng_states(world_size: int) -> list[dict[str, Any]]:
    """Every rank's RNG state, indexed by rank (a collective: all ranks must call it)."""
    local = capture_rng_state()
    if world_size <= 1 or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return [local]
    states: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(states, local)
    return states
