"""Checkpoints that survive a ``kill -9``, a signal or a full disk, and the RNG state that makes resuming exact.

* :class:`AtomicCheckpointIO` writes a checkpoint to a hidden temporary file in the target directory, flushes it
  to disk and renames it over the target (``os.replace`` is atomic on POSIX), so a kill during a save leaves the
  previous ``last.ckpt`` untouched. A full disk (``ENOSPC``/``EDQUOT``, which torch's zip writer reports as a
  ``RuntimeError`` raised while handling it) removes the partial file and raises one
  :class:`CheckpointDiskFullError` naming the directory, the space the checkpoint needs and the space free;
  nothing already written is lost. :func:`check_writable` finds an unwritable directory at startup instead.
* A distributed (FSDP2) checkpoint is a folder of shards: :func:`save_folder_atomically` has every rank write its
  shards to a hidden temporary sibling folder and rank 0 then swaps it with the target in one atomic rename
  (:func:`replace_folder`), so a kill during the save leaves the previous ``last.ckpt`` folder whole. Removing an
  old checkpoint renames it out of the way first, so a kill never leaves half a folder under a checkpoint's name.
* :class:`RLFlowCheckpoint` is Lightning's ``ModelCheckpoint`` with rlflow's defaults (``last.ckpt`` after every
  rollout step; ``every_n_train_steps`` and the ``step`` of the file names count rollout steps, see
  :mod:`rlflow.training.step_unit`), the atomic writer installed (``save_last="link"`` links atomically too),
  ``--ckpt_path last`` that finds this run's newest intact checkpoint (:func:`rlflow.training.resume.find_last`),
  and a ``last.ckpt`` of the final step written like every step checkpoint, so a finished run continues exactly
  when ``max_steps`` is raised.
* :class:`GracefulStop`: SIGTERM or SIGINT during training finishes the rollout step, saves ``last.ckpt`` and
  stops the run with :class:`StoppedBySignal` (``rlflow fit`` exits with ``128 + signal``: 143, 130); a second
  signal, or ``timeout`` seconds without reaching the end of the step, stops at once (the previous checkpoint
  stays whole).

What a checkpoint holds besides the weights (every rank's RNG state, the counters), and which checkpoint is this
run's, are :mod:`rlflow.training.resume`'s.

Simplifications: local file systems only get the atomic write (remote URLs use Lightning's writer); the partial
files and folders of a killed process are removed the next time a run sets up the same checkpoint directory; the
space a checkpoint needs is the size of its tensors. Swapping two folders in one step needs Linux's
``renameat2(RENAME_EXCHANGE)``; elsewhere (or on a file system without it) the old folder is renamed aside and the
new one into place, and a kill between those two renames is repaired when the next run sets up the directory.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from rlflow.config_error import ConfigError
from rlflow.log import info
from rlflow.training.resume import find_last
from rlflow.training.safe_load import SafeCheckpointIO

PARTIAL_PREFIX = ".partial-"
#: the suffix of a checkpoint folder renamed aside while the new one takes its name (no atomic swap available)
ASIDE_SUFFIX = ".aside"
DISK_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


class DiskFullError(OSError):
    """The disk filled up while the run wrote its logs or checkpoints; the checkpoints already on disk are intact."""


class CheckpointDiskFullError(DiskFullError):
    """The disk filled up while a checkpoint was written; the checkpoints already on disk are intact."""


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it was raised from or while handling, is a full disk or quota."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def tensor_bytes(obj: Any) -> int:
    """The bytes of the tensors in a checkpoint (nested dicts, lists and tuples): about its size on disk."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def check_writable(directory: str | os.PathLike, key: str) -> None:
    """Raise a one-line :class:`ConfigError` naming ``key`` if ``directory`` (or, where it does not exist yet,
    the nearest folder above it, where it would be created) does not take a new file. Nothing is left behind."""
    if not is_local(directory):
        return
    target = Path(str(directory).removeprefix("file://")).absolute()
    existing = target
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    problem = None
    if not existing.is_dir():
        problem = f"{existing} is not a directory"
    else:
        try:
            fd, probe = tempfile.mkstemp(prefix=".rlflow-write-check-", dir=existing)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            problem = f"cannot create a file in {existing}: {exc.strerror or exc}"
    if problem:
        raise ConfigError(f"{key}: {target} is not writable ({problem}); point {key} at a directory this user can "
                          "write")


def is_local(path: str | os.PathLike) -> bool:
    """Whether ``path`` is on a local file system (a plain path or a ``file://`` URL)."""
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


def _partial(directory: Path) -> Path:
    """A new temporary file name in ``directory``, renamed over its target once written (this process's pid in
    it: :func:`remove_stale_partials`)."""
    return directory / f"{PARTIAL_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` through a temporary file in the same directory and an atomic rename."""
    path = Path(str(path).removeprefix("file://"))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _partial(path.parent)
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if disk_full(exc):
            free = shutil.disk_usage(path.parent).free
            raise CheckpointDiskFullError(
                errno.ENOSPC,
                f"no space left on the device while writing the checkpoint {path}: it needs about "
                f"{tensor_bytes(obj) / 2**20:.1f} MiB, {free / 2**20:.1f} MiB are free in {path.parent}. The "
                f"checkpoints already in {path.parent} are intact. Free disk space or point --checkpoint.dirpath at a "
                "larger disk, then continue with --ckpt_path last",
            ) from exc
        raise
    _fsync_dir(path.parent)


class AtomicCheckpointIO(SafeCheckpointIO):
    """``TorchCheckpointIO`` whose saves are atomic (a kill or a full disk never leaves a broken checkpoint) and
    whose reads never unpickle (:class:`~rlflow.training.safe_load.SafeCheckpointIO`: ``weights_only=True``, a URL
    downloaded afresh)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or not is_local(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_torch_save(checkpoint, path)

    def remove_checkpoint(self, path: Any) -> None:
        """A local checkpoint folder (FSDP2's) is renamed aside before it is deleted: a kill during the deletion
        leaves a hidden partial folder (removed by the next run), never half a checkpoint under its name."""
        local = Path(str(path).removeprefix("file://"))
        if is_local(path) and local.is_dir() and not local.is_symlink():
            aside = _partial(local.parent)
            os.rename(local, aside)
            _remove(aside)
            return
        super().remove_checkpoint(path)


# ---------------------------------------------------------------------------------- checkpoint folders (FSDP2)
def _remove(path: Path) -> None:
    """Delete a file, link or folder (whichever ``path`` is)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names of ``a`` and ``b`` in one atomic step (Linux ``renameat2`` with ``RENAME_EXCHANGE``); False,
    with nothing changed, where the system or the file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, f"cannot swap {a} and {b}: {os.strerror(code)}")


def replace_folder(new: str | os.PathLike, path: str | os.PathLike) -> None:
    """Put the fully written ``new`` (a sibling of ``path``) at ``path``, then delete what was there.

    Where ``path`` exists the two are swapped in one atomic step (:func:`_exchange`), so ``path`` is always the
    old checkpoint or the new one, whole. Without an atomic swap the old one is renamed aside
    (``.partial-<pid>-<id>-<name>.aside``) and ``new`` renamed into place; :func:`remove_stale_partials` puts an
    aside folder back if a kill came between the two renames.
    """
    new, path = Path(new), Path(path)
    if not os.path.lexists(path):
        os.rename(new, path)
    elif _exchange(new, path):
        _remove(new)  # the previous checkpoint, under the temporary name now
    else:
        aside = path.parent / f"{_partial(path.parent).name.removesuffix('.tmp')}-{path.name}{ASIDE_SUFFIX}"
        os.rename(path, aside)
        os.rename(new, path)
        _remove(aside)
    _fsync_dir(path.parent)


def save_folder_atomically(strategy: Any, path: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Write a checkpoint folder with every rank of ``strategy`` through ``write(folder)`` into a temporary sibling
    of ``path`` (named by rank 0), then let rank 0 put it at ``path`` (:func:`replace_folder`). A failure or a kill
    before the rename leaves ``path`` as it was; the temporary folder is removed (by the next run after a kill)."""
    path = Path(strategy.broadcast(str(Path(str(path).removeprefix("file://")).absolute())))
    if strategy.is_global_zero:
        path.parent.mkdir(parents=True, exist_ok=True)
    new = Path(strategy.broadcast(str(_partial(path.parent)) if strategy.is_global_zero else None))
    try:
        write(new)
        if strategy.is_global_zero:
            for file in new.iterdir():  # the shards are synced by their writer; the metadata file here
                if file.is_file():
                    with open(file, "rb+") as f:
                        os.fsync(f.fileno())
            _fsync_dir(new)
        strategy.barrier()
        if strategy.is_global_zero:
            replace_folder(new, path)
        strategy.barrier()
    except BaseException:
        if strategy.is_global_zero:
            _remove(new)
        raise


def remove_stale_partials(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporary files and folders that processes no longer running left behind in ``directory``; a
    checkpoint folder such a process had renamed aside (:func:`replace_folder`) goes back under its name if
    nothing took it, else is deleted too."""
    removed = []
    directory = Path(directory)
    if not directory.is_dir():
        return removed
    for tmp in directory.glob(f"{PARTIAL_PREFIX}*"):
        match = re.match(rf"{re.escape(PARTIAL_PREFIX)}(\d+)-[0-9a-f]{{8}}(?:-(.+){re.escape(ASIDE_SUFFIX)}|\.tmp)$",
                         tmp.name)
        if match is None or _alive(int(match.group(1))):
            continue
        original = directory / match.group(2) if match.group(2) else None
        if original is not None and not os.path.lexists(original):
            os.rename(tmp, original)
            info(f"checkpoint {original} put back: a run was stopped while it replaced it")
            continue
        _remove(tmp)
        removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    """Whether process ``pid`` (this one included) is running."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
        return pid > 0
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    except PermissionError:
        return True


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
        if type(trainer.strategy.checkpoint_io) in (TorchCheckpointIO, SafeCheckpointIO):
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        if trainer.is_global_zero and self.dirpath and is_local(self.dirpath):
            remove_stale_partials(self.dirpath)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        # Lightning warns on every save of a manually optimised module that the checkpoint holds the weights
        # *after* the optimizer step: that is exactly what a resume needs here.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            if self.save_last and _run_ends_here(trainer) and not self._should_skip_saving_checkpoint(trainer) \
                    and (not self._defer_save_until_validation or trainer.received_sigterm):
                self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # A resumed run logs to a new version directory; Lightning's warning about it is expected, not a problem.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The dirpath has changed")
            super().load_state_dict(state_dict)

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        """``ckpt_path="last"`` given to ``Trainer.fit`` directly: this run's newest intact checkpoint, compared on
        the module's hyper-parameters (``rlflow fit`` resolves ``last`` itself, against its whole configuration)."""
        module = trainer.lightning_module
        found = find_last(trainer, {"model": dict(module.hparams)} if module is not None else {})
        return {str(found)} if found is not None else set()

    @staticmethod
    def _link_checkpoint(trainer: Any, filepath: str, linkpath: str) -> None:
        """``save_last="link"``: the link replaced atomically (a new link renamed over the old one), so that a kill
        never leaves the directory without a ``last.ckpt``."""
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            link = Path(linkpath)
            tmp = _partial(link.parent)
            try:
                os.symlink(os.path.relpath(filepath, link.parent), tmp)
            except OSError:  # no symbolic links here: a copy, written atomically as well
                shutil.copy(filepath, tmp)
            if link.is_dir() and not link.is_symlink():  # a checkpoint folder (FSDP2's) there: swapped out whole
                replace_folder(tmp, link)
            else:
                os.replace(tmp, link)
        trainer.strategy.barrier()


def _run_ends_here(trainer: Any) -> bool:
    """Whether ``fit`` stops after the current rollout step (``max_steps`` reached, a callback stopped it, or a
    signal did: :class:`GracefulStop`).

    The last checkpoint of such a run must be written now, in ``on_train_batch_end``, like every step checkpoint:
    Lightning's own end-of-run save (``on_train_end``, for a final step that ``every_n_train_steps`` skips) comes
    after the loops have closed the epoch, so ``--ckpt_path last`` with a larger ``max_steps`` would start a new
    epoch and throw away the sampler's place in the unfinished one.
    """
    if trainer.max_steps is not None and 0 <= trainer.max_steps <= trainer.global_step:
        return True
    return trainer.received_sigterm or bool(trainer.should_stop) and trainer.fit_loop._can_stop_early


# ------------------------------------------------------------------------------------------------ signals
#: Seconds :class:`GracefulStop` waits for the end of the rollout step by default (``RLFLOW_STOP_TIMEOUT``).
STOP_TIMEOUT = 300.0


class StoppedBySignal(BaseException):  # noqa: N818 - not an error: the run was told to stop
    """The run stopped on a signal (not an ``Exception``: code that catches those must not swallow it).

    ``saved``: the checkpoint written at the step boundary (None: stopped in the middle of a step, or nothing was
    saved); ``exit_code``: ``128 + signal`` (143 for SIGTERM, 130 for SIGINT), what a shell reports for a process
    the signal ended."""

    def __init__(self, signum: int, step: int, saved: str | None, boundary: bool, reason: str = "") -> None:
        self.signum, self.step, self.saved, self.boundary = signum, step, saved, boundary
        self.exit_code = 128 + signum
        name = signal.Signals(signum).name
        if boundary:
            where = f"after rollout step {step}: " + (
                f"checkpoint {saved}; continue with --ckpt_path last" if saved
                else "no checkpoint written (checkpointing or checkpoint.save_last is off)")
        else:
            where = (f"in rollout step {step + 1}{reason}, without finishing it: the checkpoints already written "
                     "are intact; continue with --ckpt_path last")
        super().__init__(f"stopped by {name} {where} (exit code {self.exit_code})")


class GracefulStop(Callback):
    """SIGTERM and SIGINT during training: finish the rollout step (and its evaluation), save ``last.ckpt``, stop.

    The first signal is noted (one line) and the run stops at the end of the current rollout step, through
    Lightning's own stop (``trainer.received_sigterm``): the step's metrics are logged, the checkpoint callback
    writes ``last.ckpt`` whatever ``every_n_train_steps`` says, and ``fit`` ends with Lightning's
    ``SIGTERMException``, which ``rlflow fit`` reports as :class:`StoppedBySignal`. A second signal, or
    ``timeout`` seconds without reaching the end of the step, raise :class:`StoppedBySignal` where the run is
    (the step is lost; the previous checkpoint is whole: saves are atomic). All ranks stop at the same step (the
    flag is reduced across ranks at each step's end). The handlers are installed when training starts and put
    back with Lightning's own at the end of ``fit``; before that, the signals do what they did.

    Args:
        timeout: Seconds to wait for the end of the rollout step after the first signal (None: no bound).
    """

    def __init__(self, timeout: float | None = STOP_TIMEOUT) -> None:
        self.timeout = timeout
        self.signum: int | None = None
        self.stopping = False
        self.timed_out = False
        self._trainer: Any = None
        self._timer: threading.Timer | None = None

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # handlers can only be installed from the main thread
        self._trainer = trainer
        for number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(number, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        trainer = self._trainer
        if self.signum is not None:  # a second signal, or the timeout: stop now
            if self.timed_out and self._timer is None:
                return  # the timeout, come after the run stopped waiting for it
            self._cancel_timer()
            reason = f" (its end not reached within {self.timeout:g} s)" if self.timed_out else " (a second signal)"
            raise StoppedBySignal(self.signum, trainer.global_step, None, False, reason)
        self.signum = signum
        launcher = trainer.strategy.launcher
        if launcher is not None:  # Lightning's processes of the other ranks stop with this one
            launcher.kill(signum)
        bound = f" (at most {self.timeout:g} s)" if self.timeout else ""
        try:
            info(f"{signal.Signals(signum).name}: stopping at the end of this rollout step, with a checkpoint{bound}; "
                 "a second signal stops at once")
        except RuntimeError:  # the signal came in the middle of a write to the same stream: the line is left out
            pass
        if self.timeout:
            self._timer = threading.Timer(self.timeout, self._time_out)
            self._timer.daemon = True
            self._timer.start()

    def _time_out(self) -> None:
        if self._timer is None:  # cancelled meanwhile
            return
        self.timed_out = True
        # the signal again, to the main thread itself: it interrupts a wait there (a sleep, a lock) as a real one does
        signal.pthread_kill(threading.main_thread().ident, self.signum)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Runs before the checkpoint callbacks (Lightning orders those last): a stop noted now makes this step's
        ``last.ckpt`` (:func:`_run_ends_here`)."""
        requested = self.signum is not None
        if trainer.world_size > 1:
            flag = torch.tensor(float(requested), device=trainer.strategy.root_device)
            requested = bool(trainer.strategy.reduce(flag, reduce_op="sum") > 0)
            if requested and self.signum is None:
                self.signum = int(signal.SIGTERM)
        if requested:
            self.stopping = True
            trainer._signal_connector.received_sigterm = True

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self.stopping:  # let this step's evaluation finish (Lightning would cut it short)
            trainer._signal_connector.received_sigterm = False

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self.stopping:
            trainer._signal_connector.received_sigterm = True

    def stopped(self, trainer: Any) -> StoppedBySignal:
        """The :class:`StoppedBySignal` of a stop at the step boundary (Lightning's ``SIGTERMException``)."""
        saved = None
        callback = trainer.checkpoint_callback
        if callback is not None and getattr(callback, "_last_global_step_saved", None) == trainer.global_step:
            saved = callback.last_model_path or callback.best_model_path or None
        return StoppedBySignal(self.signum or int(signal.SIGTERM), trainer.global_step, saved, True)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._cancel_timer()  # before Lightning puts the handlers back

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._cancel_timer()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._cancel_timer()
