"""Which checkpoint ``--ckpt_path`` resumes, and what it holds besides the weights so that the run continues
where it stopped.

:func:`choose_checkpoint` (``rlflow fit``, before anything loads) and :func:`find_last` (``Trainer.fit(ckpt_path=
"last")``) pick this run's checkpoint. A run is its logger version: a named one (``trainer.logger.version``, or
``checkpoint.dirpath``) holds this run's checkpoints; without a name, each start gets a new ``version_N``, and
the run's checkpoints are those of the versions that train what this config trains (:data:`IDENTITY`: the same
model, LoRA, loss, group size, optimizer, training data and seed; any other setting may have changed since, and
runs that differ only there are told apart by naming their versions). Newest first, a checkpoint that does not
load (truncated, corrupt) is passed over with one line. Settings that differ from the chosen checkpoint's run are
listed in one line; those a run cannot change (:data:`FIXED`) are refused in one line. Checkpoints keep the run's
whole configuration (``ResumeState.config``) for this comparison; older ones are compared on their
hyper-parameters.

:class:`ResumeState` is the part of :class:`~rlflow.training.module.GRPOModule` that writes and reads the
checkpoint's ``rlflow`` entry: the counters (policy version, tokens, skipped optimizer steps), the loss's own
training state, the length of the learning-rate schedule, every rank's RNG state (:func:`capture_rng_state`:
the Python, NumPy and torch generators, CPU and CUDA) and the configuration. The RNG states and the optimizer
settings are applied in ``on_train_start``, once Lightning has finished its own set-up (seeding, restoring the
optimizer and scheduler): sampling after a resume draws what it would have drawn, a changed ``model.optim``
(learning rate, betas, weight decay, warm-up, schedule) is what the run trains at, instead of the values the
optimizer state brought back, and a run continued with another ``trainer.max_steps`` lets a decaying schedule end
where the new run ends (:meth:`ResumeState.apply_optim`).

:func:`checkpoint_state` and :func:`loadable_state` are what the module's ``state_dict``/``load_state_dict``
add: under ``model.lora`` a checkpoint leaves out the frozen base weights; a moved KL reference
(``model.reference.sync_steps``) is checkpointed, and a resumed run that switched syncing on or off adapts.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import pickle
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlflow.config_error import ConfigError
from rlflow.log import info
from rlflow.training.optim import rebuild_lr_scheduler

#: The module's counters a checkpoint holds, with their values before the first step.
COUNTERS = {"policy_version": 0, "num_tokens": 0.0, "skipped_steps": 0, "consecutive_skips": 0}


class ResumeState:
    """The checkpoint's ``rlflow`` entry of one module (see the module docstring)."""

    def __init__(self) -> None:
        self.config: dict[str, Any] | None = None  # the run's resolved configuration (rlflow fit sets it)
        self.rng: list[dict[str, Any]] | None = None  # loaded, applied in on_train_start
        self.lr_steps: int | None = None  # the checkpoint's schedule length, compared in on_train_start
        self.optim: dict[str, Any] | None = None  # the checkpoint's model.optim, compared in on_train_start
        self.steps_taken: int | None = None  # the checkpoint's optimizer steps (its scheduler's count)

    def save(self, module: Any, checkpoint: dict[str, Any]) -> None:
        """``on_save_checkpoint``: the counters, the schedule length, every rank's RNG, the loss's state and the
        configuration."""
        trainer = module._trainer
        checkpoint["rlflow"] = {
            **{name: getattr(module, name) for name in COUNTERS},
            "lr_schedule_steps": getattr(module, "lr_schedule_steps", None),
            # every rank's Python/NumPy/torch RNG, so sampling after a resume draws what it would have drawn
            "rng": gather_rng_states(trainer.world_size if trainer is not None else 1),
            "loss": module.loss_fn.state_dict(),  # a loss's own training state (adaptive entropy control)
            **({"config": self.config} if self.config is not None else {}),  # what a resume compares its own with
        }

    def load(self, module: Any, checkpoint: dict[str, Any]) -> None:
        """``on_load_checkpoint``: the counters and the loss's state now, the RNG and optimizer settings at train
        start. A scheduler of another shape (``lr_schedule``, ``warmup_steps``) is not loaded into this run's: torch
        cannot; :meth:`apply_optim` builds this run's at the optimizer step reached."""
        state = checkpoint.get("rlflow", {})
        for name, default in COUNTERS.items():
            setattr(module, name, state.get(name, default))
        module.loss_fn.load_state_dict(state.get("loss", {}))
        self.rng = state.get("rng")
        self.lr_steps = state.get("lr_schedule_steps")
        saved = checkpoint.get("hyper_parameters", {}).get("optim")
        self.optim = dict(saved) if isinstance(saved, dict) else None
        schedulers = checkpoint.get("lr_schedulers") or []
        self.steps_taken = schedulers[0].get("last_epoch") if schedulers else None
        if self.optim is not None and _differ(self.optim, module.settings.optim, ("lr_schedule", "warmup_steps")):
            checkpoint["lr_schedulers"] = []
        trainer, step = module._trainer, checkpoint.get("global_step", 0)
        if trainer is not None and trainer.state.fn == "fit" and 0 <= (trainer.max_steps or -1) <= step:
            info(f"the checkpoint is at rollout step {step} and trainer.max_steps={trainer.max_steps}: the run is "
                 "already finished, nothing is trained (raise --trainer.max_steps to continue it)")

    def on_train_start(self, module: Any) -> None:
        """Restore this rank's RNG state (when the checkpoint has one per rank of this run), then apply this run's
        optimizer settings."""
        states, self.rng = self.rng, None
        trainer = module.trainer
        if states and trainer.state.fn == "fit":
            if len(states) == trainer.world_size:
                restore_rng_state(states[trainer.global_rank])
            else:
                info(f"the checkpoint holds RNG states of {len(states)} rank(s), this run has "
                     f"{trainer.world_size}: sampling continues from a fresh seed, not bit-exactly")
        self.apply_optim(module)

    def apply_optim(self, module: Any) -> None:
        """After a resume, train at this run's ``model.optim``: the optimizer state Lightning restored holds the
        checkpoint's learning rate, betas and weight decay in its parameter groups, and its scheduler the
        checkpoint's schedule. Where they differ, or where a decaying schedule spans another number of steps (a run
        continued with another ``max_steps``), the groups take this run's values and the schedule is this run's
        at the optimizer step reached (:func:`~rlflow.training.optim.rebuild_lr_scheduler`); the moments stay."""
        saved, self.optim = self.optim, None
        saved_total, self.lr_steps = self.lr_steps, None
        taken, self.steps_taken = self.steps_taken, None
        optim, configs = module.settings.optim, module.trainer.lr_scheduler_configs
        if not configs or (saved is None and saved_total is None):  # not resumed
            return
        total = module.lr_schedule_steps
        changed = _differ(saved or {}, optim, ("lr", "betas", "weight_decay", "warmup_steps", "lr_schedule"))
        respan = saved_total is not None and saved_total != total and optim.lr_schedule != "constant"
        if not changed and not respan:
            return
        optimizer = configs[0].scheduler.optimizer
        if changed:
            for group in optimizer.param_groups:
                group["initial_lr"] = optim.lr
                group.update({k: v for k, v in (("betas", tuple(optim.betas)), ("weight_decay", optim.weight_decay))
                              if k in group})
        taken = configs[0].scheduler.last_epoch if taken is None else taken
        configs[0].scheduler = rebuild_lr_scheduler(optimizer, optim.lr_schedule, optim.warmup_steps, total, taken)
        lr = float(optimizer.param_groups[0]["lr"])
        what = ", ".join(f"{k} {_show((saved or {}).get(k))} -> {_show(getattr(optim, k))}" for k in changed)
        span = f"model.optim.lr_schedule={optim.lr_schedule} spans {total} optimizer steps now (the checkpoint's " \
               f"run: {saved_total})" if respan else ""
        info(f"{'; '.join(x for x in (f'model.optim: {what}' if what else '', span) if x)}; continuing at step "
             f"{taken}, lr {lr:.3g}")


def _differ(saved: dict[str, Any], optim: Any, keys: tuple[str, ...]) -> list[str]:
    """The ``keys`` of a checkpoint's ``model.optim`` (a plain mapping) whose values this run's ``optim`` changes."""
    return [k for k in keys if k in saved and _plain(saved[k]) != _plain(getattr(optim, k))]


# ------------------------------------------------------------------------------------------ which checkpoint
#: Settings a resumed run cannot change, with why: ``--ckpt_path`` with another value is refused in one line.
FIXED = {
    "model.model_path": "the checkpoint's weights are that model's",
    "model.lora": "the checkpoint holds the weights it trained (adapters or the full model)",
    "model.loss": "the loss's own state and the objective the run optimises",
    "data.prompt_repeat_k": "the group size (the replay buffer's groups and the advantages)",
    "model.optim.optimizer": "the optimizer's state is that optimizer's",
}
#: What a run trains: an unnamed version whose checkpoint differs here is another run's (every other setting, the
#: learning rate, sampling, the reference, the trainer's, may change when a run is resumed).
IDENTITY = (*FIXED, "data.train_data_path", "data.seed")
#: Never compared: how this invocation was given, not what the run is.
UNCOMPARED = ("ckpt_path", "config", "__path__")


def _plain(value: Any) -> Any:
    """``value`` with tuples as lists and settings dataclasses as mappings (a checkpoint's form of settings)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _show(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(_plain(value), default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _within(key: str, prefixes: Any) -> bool:
    """Whether dotted ``key`` is one of ``prefixes`` or inside one (``model.optim.`` holds ``model.optim.lr``)."""
    return any(key == p.rstrip(".") or key.startswith(p.rstrip(".") + ".") for p in prefixes)


def setting_changes(saved: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """``(key, saved value, current value)`` of every setting that differs, by dotted key, in the sections both
    configurations have (a checkpoint without its configuration has only ``model``)."""
    changes = []
    for key in sorted(saved.keys() & current.keys() if not prefix else saved.keys() | current.keys()):
        name = f"{prefix}{key}"
        if _within(name, UNCOMPARED):
            continue
        old, new = _plain(saved.get(key)), _plain(current.get(key))
        if isinstance(old, dict) and isinstance(new, dict):
            changes += setting_changes(old, new, name + ".")
        elif old != new:
            changes.append((name, old, new))
    return changes


def _identity(changes: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
    """The changes that make a run another run (:data:`IDENTITY`)."""
    return [c for c in changes if _within(c[0], IDENTITY)]


def _list(changes: list[tuple[str, Any, Any]]) -> str:
    return ", ".join(f"{key} {_show(old)} -> {_show(new)}" for key, old, new in changes)


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, Any] | None, str]:
    """A checkpoint's contents, memory-mapped (its tensors are not read), and "" ; or None and why it does not load
    (a truncated or corrupt file). A sharded (FSDP2) checkpoint folder is read from its ``meta.pt``."""
    path = Path(path)
    file = path / "meta.pt" if path.is_dir() else path
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True), ""
    except pickle.UnpicklingError as exc:  # whole, but more than tensors and plain values: not rlflow's to read
        return None, f"it holds more than tensors and plain values: {str(exc).splitlines()[0][:120]}"
    except Exception as exc:  # noqa: BLE001 - any failure to load is the reason this one is passed over
        return None, (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]


def saved_settings(state: dict[str, Any]) -> dict[str, Any]:
    """The configuration of the run that wrote a checkpoint: its own (``rlflow fit``), else its module's
    hyper-parameters as the ``model`` section."""
    config = state.get("rlflow", {}).get("config")
    if isinstance(config, dict):
        return config
    return {"model": {k: v for k, v in state.get("hyper_parameters", {}).items() if not k.startswith("_")}}


def checkpoint_dir(trainer: Any) -> Path:
    """The directory Lightning's checkpoint callback writes to: ``checkpoint.dirpath``, else
    ``<save_dir>/<name>/<version>/checkpoints`` of the first logger, else ``<default_root_dir>/checkpoints``."""
    callback = trainer.checkpoint_callback
    if callback is not None and callback.dirpath:
        return Path(callback.dirpath)
    if not trainer.loggers:
        return Path(trainer.default_root_dir) / "checkpoints"
    version = trainer.loggers[0].version
    return _logger_root(trainer) / (version if isinstance(version, str) else f"version_{version}") / "checkpoints"


def _logger_root(trainer: Any) -> Path:
    """The first logger's directory of versions, ``<save_dir>/<name>``."""
    logger = trainer.loggers[0]
    return Path(logger.save_dir or trainer.default_root_dir) / str(logger.name)


def version_named(trainer: Any) -> bool:
    """Whether this run's checkpoints are in one folder by name: ``checkpoint.dirpath``, no logger, or a logger
    version given (``trainer.logger.version``; read before anything asks the logger its version, which settles
    an unnamed one on the next ``version_N``)."""
    callback, loggers = trainer.checkpoint_callback, trainer.loggers
    if not loggers or (callback is not None and callback.dirpath):
        return True
    return getattr(loggers[0], "_version", getattr(loggers[0], "_id", None)) is not None


def run_directories(trainer: Any, named: bool) -> tuple[list[Path], str]:
    """The folders this run's checkpoints may be in, and where that is (for messages): by name (``named``, see
    :func:`version_named`), its checkpoint directory; without a name, where each start of a run gets a new
    version, the checkpoint directories of every version of the logger's directory."""
    if named:
        directory = checkpoint_dir(trainer)
        return [directory], str(directory)
    root = _logger_root(trainer)
    return sorted(root.glob("*/checkpoints")), f"{root} (every version)"


def _candidates(directories: list[Path]) -> list[Path]:
    """The checkpoints in ``directories``, newest first (``last*.ckpt`` first of those written together)."""
    found = [p for d in directories if d.is_dir() for p in d.iterdir() if p.suffix == ".ckpt"]
    return sorted(found, key=lambda p: (p.stat().st_mtime, p.name.startswith("last")), reverse=True)


def find_last(trainer: Any, current: dict[str, Any], named: bool | None = None) -> Path | None:
    """``--ckpt_path last``: this run's newest checkpoint that loads, said in one line (so is its absence, and a
    newer one that does not load). ``current``: this run's configuration (or its ``model`` section); ``named``:
    :func:`version_named`, when it was read before the logger settled its version."""
    named = version_named(trainer) if named is None else named
    directories, where = run_directories(trainer, named)
    broken: list[tuple[Path, str]] = []
    others: list[tuple[Path, list[tuple[str, Any, Any]]]] = []
    for path in _candidates(directories):
        state, reason = read_checkpoint(path)
        if state is None:
            broken.append((path, reason))
            continue
        differ = _identity(setting_changes(saved_settings(state), current))
        if not named and differ:
            others.append((path, differ))
            continue
        resumed = f"resuming {path}"
        if broken:
            more = f" (and {len(broken) - 1} newer)" if len(broken) > 1 else ""
            resumed = (f"{broken[0][0]}{more} is truncated or corrupt ({broken[0][1]}): resuming {path} instead, "
                       "the newest intact checkpoint of this run,")
        _resume(trainer, "--ckpt_path last", resumed, state, current)
        return path
    line = f"--ckpt_path last: no checkpoint of this run in {where}: training starts from step 0"
    if others:
        path, differ = others[0]
        version = path.parent.parent.name
        hint = "" if any(_within(c[0], FIXED) for c in differ) else \
            f"; to continue it with this run's settings, name its version: --trainer.logger.version {version}"
        line += f" (the newest other run there, {version}, differs: {_list(differ[:3])}{hint})"
    if broken:
        line += f" ({len(broken)} checkpoint(s) that do not load passed over: {broken[0][0]}: {broken[0][1]})"
    info(line)
    return None


def choose_checkpoint(ckpt_path: Any, trainer: Any, current: dict[str, Any], named: bool | None = None) -> Any:
    """What ``rlflow fit --ckpt_path`` resumes: ``last`` as :func:`find_last`; a local file checked to load
    (one line if it does not) and compared like ``last``'s. Anything else (``hpc``, ``best``, a URL, a path that
    does not exist) is left to Lightning."""
    if ckpt_path == "last":
        return find_last(trainer, current, named)
    if not isinstance(ckpt_path, (str, os.PathLike)) or "://" in str(ckpt_path) or not os.path.exists(ckpt_path):
        return ckpt_path
    state, reason = read_checkpoint(ckpt_path)
    if state is None and reason.startswith("it holds more than"):
        return ckpt_path  # the checkpoint reader refuses it, saying why (rlflow.training.safe_load)
    if state is None:
        raise ConfigError(f"--ckpt_path {ckpt_path} cannot be read ({reason}): the file is truncated or corrupt; "
                          "--ckpt_path last resumes the newest intact checkpoint of this run")
    _resume(trainer, f"--ckpt_path {ckpt_path}", "resuming it", state, current)
    return ckpt_path


def _resume(trainer: Any, what: str, resumed: str, state: dict[str, Any], current: dict[str, Any]) -> None:
    """One line: the checkpoint ``resumed``, its step and the settings that changed since its run; a change of
    a :data:`FIXED` setting is refused in one line instead (``what``: the option, for both). The log rows of
    a named version before the checkpoint's step stay (:func:`keep_csv_rows`)."""
    changes = setting_changes(saved_settings(state), current)
    fixed = [c for c in changes if _within(c[0], FIXED)]
    if fixed:
        why = "; ".join(f"{key}: {reason}" for key, reason in FIXED.items()
                        if any(_within(c[0], (key,)) for c in fixed))
        raise ConfigError(f"{what}: a resumed run cannot change {_list(fixed)} ({why}); put them "
                          "back, or start a new run (without --ckpt_path, or in another trainer.logger.version)")
    line = f"{what}: {resumed} at rollout step {state.get('global_step', 0)}"
    if changes:
        line += f"; settings that differ from the checkpoint's run (this run's apply): {_list(changes)}"
    info(line)
    keep_csv_rows(trainer, int(state.get("global_step", 0)))


def keep_csv_rows(trainer: Any, step: int) -> None:
    """A CSV logger writing into an existing version folder (a named version resumed) deletes its
    ``metrics.csv`` (Lightning's behaviour): keep the rows of the steps before ``step`` (those the checkpoint
    has trained) and append to them."""
    from lightning.pytorch.loggers import CSVLogger

    logger = trainer.loggers[0] if trainer.loggers and trainer.global_rank == 0 else None
    path = Path(logger.log_dir) / "metrics.csv" if isinstance(logger, CSVLogger) else None
    if path is None or not path.is_file() or logger._experiment is not None:
        return
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        keys = list(reader.fieldnames or [])
        rows = [row for row in reader if row.get("step") and int(float(row["step"])) < step]
    with warnings.catch_warnings():  # "Previous log files ... will be deleted": they are kept here
        warnings.filterwarnings("ignore", message="Experiment logs directory")
        writer = logger.experiment  # Lightning's writer: it removes the file
    with open(path, "w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=keys)
        out.writeheader()
        out.writerows(rows)
    writer.metrics_keys = keys


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


# --------------------------------------------------------------------------------------------- weights
def checkpoint_state(module: Any, state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The module's ``state_dict`` as checkpoints hold it: under ``model.lora`` without the frozen base weights
    (they are ``model.model_path``'s), so checkpoints hold the adapters, and the optimizer state only theirs."""
    if module.peft_model is None:
        return state
    from rlflow.models.lora import frozen_keys, trainable_state

    return trainable_state(state, frozen_keys(module.policy, prefix + "policy."))


def loadable_state(module: Any, state_dict: Any, live: Callable[[], dict[str, Any]]) -> Any:
    """A checkpoint's ``state_dict`` as the module loads it (``live``: the module's own full state dict): under
    ``model.lora`` the missing base weights are the live (never trained) ones; the ``reference.*`` entries as
    :func:`reference_entries` says."""
    state_dict = reference_entries(module, state_dict)
    if module.peft_model is None:
        return state_dict
    from rlflow.models.lora import complete_state, frozen_keys

    return complete_state(state_dict, live(), frozen_keys(module.policy, "policy."))


def reference_entries(module: Any, state_dict: Any) -> Any:
    """``state_dict`` with the ``reference.*`` entries this module has. A checkpoint without the reference
    (``model.reference.sync_steps`` was 0) continues with the reference as loaded; one with a moved reference
    continues with that one, synced or not (the module then checkpoints it too); a run without a KL term drops
    it."""
    saved = any(k.startswith("reference.") for k in state_dict)
    if saved and "reference" not in module._modules and module.outside.reference is not None:
        info("the checkpoint holds a KL reference moved by model.reference.sync_steps: this run continues "
             "with it, and with model.reference.sync_steps=0 it stays there")
        module.adopt_reference()
    if saved == ("reference" in module._modules):
        return state_dict
    if not saved:
        info("the checkpoint holds no KL reference (saved with model.reference.sync_steps=0): the reference "
             "starts from model.reference.path / model.model_path and moves from here")
        return {**state_dict, **module.reference.state_dict(prefix="reference.")}
    return {k: v for k, v in state_dict.items() if not k.startswith("reference.")}  # no KL term now
