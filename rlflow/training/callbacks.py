"""What a user watches while a run goes: a rollout progress bar, a summary line per step, W&B tables and config.

* :class:`RolloutProgressBar`: a bar beside Lightning's training bar (rich or tqdm) that counts the completions
  of the current rollout step (done of total) and the generation speed in tokens/s. It advances per backend
  call, or per batch for a backend whose ``generate`` accepts ``progress=fn(completions, tokens)``.
* :class:`StepSummary`: one line per rollout step: reward, accuracy (share of completions whose reward reaches
  ``data.eval.pass_threshold``, logged as ``train/accuracy``), completion lengths, the clipped share and the step
  time.
* :class:`NoSignalWarning`: a warning when, for several steps in a row, every group's rewards were equal (zero
  advantages: the rewards train nothing), with the figures that usually explain it.
* :class:`SampleTable`: every N steps, a W&B table of sample completions with their prompts, rewards and
  advantages, and the columns judgers added with TRL's ``log_extra`` (only for a ``WandbLogger``; the CSV and
  TensorBoard loggers have ``trajectories.jsonl`` instead).
* :class:`TrajectoryWriter`: every rollout step's samples appended to ``<log_dir>/trajectories.jsonl`` (one file
  per rank).

The step's samples and metrics come from the :class:`~rlflow.data.experience.RolloutStep` the module keeps as
``pl_module.last_rollout``.
* :class:`StepsRichProgressBar`: Lightning's rich bar without the "Epoch 4/-2" of a run bounded by
  ``max_steps`` (rlflow's default bar where rich is installed and no bar is configured).
* :class:`LoggerSaveConfigCallback`: LightningCLI's config writer that also sends the full resolved config
  (``rlflow fit --print_config``'s output) to every logger, so a W&B run shows it under *Config*.

Simplifications: the rollout bar is drawn on rank 0 only, and only beside Lightning's own bars; the
samples table shows the first ``num_samples`` samples (or prompts) of rank 0's rollout step.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import yaml
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.cli import SaveConfigCallback

from rlflow.config_error import ConfigError

SAMPLE_COLUMNS = ["step", "data_source", "prompt", "completion", "ground_truth", "reward", "advantage", "num_tokens",
                  "finish_reason", "judgers_failed"]
EVAL_SAMPLE_COLUMNS = ["trained_steps", "data_source", "prompt", "sample", "completion", "ground_truth", "answer",
                       "reward", "correct", "num_tokens", "finish_reason", "judgers_failed"]
#: Fields of the sample rows the tables leave out; any other field beyond the columns above is a judger's
#: ``log_extra`` column.
UNSHOWN_FIELDS = {"rank", "group", "policy_version", "token_versions", "batch"}


def table_columns(columns: list[str], samples: list[dict]) -> list[str]:
    """``columns``, then the columns judgers logged (``log_extra``) in ``samples``, in the order they first come."""
    known = {*columns, *UNSHOWN_FIELDS}
    return columns + list(dict.fromkeys(key for sample in samples for key in sample if key not in known))


def _cell(sample: dict, column: str) -> Any:
    """A samples-table cell: the sample's value; ``judgers_failed`` as one string ("" where no judger failed)."""
    if column == "judgers_failed":
        return ", ".join(sample.get(column) or [])
    return sample.get(column)


def _samples(pl_module: Any) -> list[dict]:
    """The latest rollout step's sample rows (none before the first step)."""
    rollout = getattr(pl_module, "last_rollout", None)
    return rollout.samples if rollout is not None else []


def _eval_samples(outputs: Any) -> list[dict]:
    """The sample rows a validation step returned (none where it returned none)."""
    return outputs.get("samples", []) if isinstance(outputs, dict) else []


def _wandb_loggers(trainer: Any) -> list[Any]:
    """The trainer's W&B loggers (the only ones that take tables)."""
    from lightning.pytorch.loggers import WandbLogger

    return [lg for lg in trainer.loggers if isinstance(lg, WandbLogger)]


def table_samples(samples: list[dict], num_samples: int, unique_prompts: bool = False) -> list[dict]:
    """The first ``num_samples`` of a step's samples; with ``unique_prompts``, of those whose prompt (and data source)
    has not been shown yet, i.e. each prompt's first completion."""
    if not unique_prompts:
        return samples[:num_samples]
    seen: set[tuple[Any, str]] = set()
    out = []
    for sample in samples:
        key = (sample.get("data_source"), json.dumps(sample.get("prompt"), sort_keys=True, default=str))
        if key not in seen:
            seen.add(key)
            out.append(sample)
            if len(out) == num_samples:
                break
    return out


def _say(trainer: Any, line: str) -> None:
    """Print a line without breaking tqdm bars."""
    bar = trainer.progress_bar_callback
    if isinstance(bar, TQDMProgressBar) and bar.is_enabled:
        bar.print(line)
    else:
        print(line, flush=True)


class StepsRichProgressBar(RichProgressBar):
    """Lightning's rich progress bar, labelled "Epoch N" where a run bounded by ``trainer.max_steps`` (rlflow's
    usual way) has ``max_epochs = -1``, which the parent class labels "Epoch N/-2"."""

    @property
    def total_train_batches(self) -> int | float:
        """The epoch's batches in the counter's units: Lightning sizes a ``max_steps`` run's bar by the steps left,
        while the counter starts at the batches of the epoch already run, which a resumed run has (``4/1``); here
        the total is those batches plus the steps left."""
        trainer = self.trainer
        if trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0:
            done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
            return min(trainer.num_training_batches, done + trainer.max_steps - trainer.global_step)
        return super().total_train_batches

    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs < 0:
            label = f"Epoch {current_epoch}"
            description = description.replace(f"{label}/{max_epochs - 1}", label)
        return description


def default_progress_bar(configured: list[Any], enabled: bool | None) -> L.Callback | None:
    """The bar rlflow adds when the trainer would pick Lightning's rich bar itself (progress bars on, rich
    installed, none among the ``configured`` callbacks); None otherwise (Lightning's choice stands)."""
    from lightning.pytorch.callbacks import ProgressBar
    from lightning.pytorch.callbacks.progress.rich_progress import _RICH_AVAILABLE

    if enabled is False or not _RICH_AVAILABLE or any(isinstance(c, ProgressBar) for c in configured):
        return None
    return StepsRichProgressBar()


class RolloutProgressBar(L.Callback):
    """A bar of the current rollout step's completions and tokens/s, beside Lightning's training bar.

    Drawn as an extra task of Lightning's rich bar, or as a second tqdm bar under Lightning's tqdm bar.
    """

    def __init__(self, enabled: bool = True) -> None:
        """
        Args:
            enabled: Draw the bar (it is also off when ``trainer.enable_progress_bar`` is false).
        """
        self.enabled = enabled
        self.lightning_bar: Any = None
        self.bar: Any = None  # a tqdm bar, or the task id in the rich bar's Progress
        self.tokens = 0
        self.started = 0.0
        self.last_rollout: dict[str, float] = {}  # the latest rollout's completions, total, tokens and seconds

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        bar = trainer.progress_bar_callback
        if (self.enabled and stage == "fit" and trainer.is_global_zero
                and isinstance(bar, (TQDMProgressBar, RichProgressBar)) and bar.is_enabled):
            self.lightning_bar = bar
            trainer.datamodule.rollout_progress = self

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if getattr(trainer.datamodule, "rollout_progress", None) is self:
            trainer.datamodule.rollout_progress = None
        self.close()

    @property
    def rich(self) -> Any:
        """The rich ``Progress`` of Lightning's rich bar, when that is the bar in use and it is live."""
        if isinstance(self.lightning_bar, RichProgressBar):
            return getattr(self.lightning_bar, "progress", None)
        return None

    # the listener protocol the datamodule calls: start(total), update(completions, tokens), close()
    def start(self, total: int) -> None:
        self.close()
        self.tokens, self.started = 0, time.perf_counter()
        self.last_rollout = {"completions": 0, "total": total, "tokens": 0, "seconds": 0.0}
        if isinstance(self.lightning_bar, RichProgressBar):
            if self.rich is not None:
                self.bar = self.rich.add_task("rollout", total=total)
            return
        from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

        self.bar = Tqdm(total=total, desc="rollout", unit="completion", position=2, leave=False, dynamic_ncols=True)

    def update(self, completions: int, tokens: int) -> None:
        self.tokens += tokens
        self.last_rollout.update(completions=self.last_rollout.get("completions", 0) + completions, tokens=self.tokens,
                                 seconds=time.perf_counter() - self.started)
        if self.bar is None:
            return
        speed = f"{self.tokens / max(time.perf_counter() - self.started, 1e-9):.0f} tok/s"
        if self.rich is not None:
            self.rich.update(self.bar, advance=completions, description=f"rollout {speed}")
        elif not isinstance(self.bar, int):
            self.bar.set_postfix_str(speed, refresh=False)
            self.bar.update(completions)

    def close(self) -> None:
        if self.bar is None:
            return
        if isinstance(self.bar, int):
            if self.rich is not None:
                self.rich.remove_task(self.bar)
        else:
            self.bar.close()
        self.bar = None


class StepSummary(L.Callback):
    """Prints one line per rollout step and logs ``train/accuracy``."""

    def __init__(self, enabled: bool = True) -> None:
        """
        Args:
            enabled: Print the line (``train/accuracy`` is logged either way).
        """
        self.enabled = enabled

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        m = getattr(pl_module, "last_metrics", None) or {}
        samples = _samples(pl_module)
        threshold = getattr(trainer.datamodule, "eval_pass_threshold", 1.0)
        counts = torch.tensor([sum(s["reward"] >= threshold for s in samples), len(samples)], dtype=torch.float64,
                              device=pl_module.device)
        passed, total = trainer.strategy.reduce(counts, reduce_op="sum").tolist()  # every rank's samples
        accuracy = passed / total if total else float("nan")
        pl_module.log("train/accuracy", accuracy, on_step=True, on_epoch=False, batch_size=max(int(total), 1))
        if not self.enabled or not trainer.is_global_zero:
            return
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else "?"

        def g(key: str) -> float:
            return float(m.get(key, float("nan")))

        _say(trainer, (
            f"[rlflow] step {trainer.global_step}/{total} | reward {g('reward'):.3f} | accuracy {accuracy:.3f} "
            f"| length {g('completions/mean_length'):.1f} (min {g('completions/min_length'):.0f}, "
            f"max {g('completions/max_length'):.0f}, clipped {100 * g('completions/clipped_ratio'):.0f}%) "
            f"| {g('step_time'):.2f} s/step (rollout {g('rollout/time'):.2f} s, {g('rollout/tokens_per_s'):.0f} tok/s) "
            f"| loss {g('loss'):.4f}"
            + (f" | GPU peak {g('memory/max_allocated_gb'):.1f} GiB" if "memory/max_allocated_gb" in m else "")
        ))


class NoSignalWarning(L.Callback):
    """Warns when, for ``patience`` rollout steps in a row, every group's completions got equal rewards.

    Why: GRPO's advantages are then all zero, so the rewards teach the policy nothing (only a KL or entropy term
    acts) while the run looks healthy: loss near 0, steps on time. The usual causes are a judger that cannot read the
    completions (answer format), completions cut at ``data.sampling.max_tokens``, or a failing judger; the warning names
    those figures. It warns once per such stretch and again if a later one follows a step with signal.
    """

    def __init__(self, patience: int = 5) -> None:
        """
        Args:
            patience: Rollout steps in a row without any group whose rewards differ before warning (0 disables it).
        """
        if patience < 0:
            raise ConfigError(f"no_signal.patience must be >= 0 (0 disables it), got {patience}")
        self.patience = patience
        self.streak = 0

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        m = getattr(pl_module, "last_metrics", None) or {}
        if not self.patience or "frac_reward_zero_std" not in m:
            return
        self.streak = self.streak + 1 if m["frac_reward_zero_std"] >= 1.0 - 1e-9 else 0
        if self.streak != self.patience:
            return
        from rlflow.log import warn

        def g(key: str) -> float:
            return float(m.get(key, 0.0))

        warn(
            f"no learning signal for {self.patience} rollout steps: in every group all completions got the same "
            f"reward (mean reward {g('reward'):.3f}), so every advantage is 0 and the rewards train nothing. "
            f"Last step: {100 * g('completions/clipped_ratio'):.0f}% of completions cut at data.sampling.max_tokens, "
            f"judger/failures {g('judger/failures'):.0f}, judger/unscored {g('judger/unscored'):.0f}. Check that "
            "the judger can read the completions' answers (trajectories.jsonl shows them), raise "
            "data.sampling.max_tokens, or start from a model that solves some prompts (--no_signal.patience 0 "
            "silences this)"
        )


class SampleTable(L.Callback):
    """Every ``every_n_steps`` rollout steps, logs a W&B table ``samples`` of completions with their rewards, and
    after every evaluation an ``eval_samples`` table of its completions with their rewards, correctness and answers."""

    def __init__(self, every_n_steps: int = 10, num_samples: int = 16, unique_prompts: bool = False) -> None:
        """
        Args:
            every_n_steps: Rollout steps between two tables (0 disables them); the first step always logs one.
            num_samples: Rows per table (the first samples of the step, whole groups first).
            unique_prompts: One row per prompt, its first completion (TRL's ``log_unique_prompts``), so a table
                shows ``num_samples`` different prompts instead of a few groups.
        """
        if every_n_steps < 0 or num_samples < 1:
            raise ConfigError(
                f"samples.every_n_steps must be >= 0 and samples.num_samples >= 1, got {every_n_steps}, {num_samples}"
            )
        self.every_n_steps = every_n_steps
        self.num_samples = num_samples
        self.unique_prompts = unique_prompts
        self.eval_rows: list[dict] = []  # the current evaluation's table rows (on_validation_batch_end)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.every_n_steps or not trainer.is_global_zero:
            return
        if (trainer.global_step - 1) % self.every_n_steps:  # the first step, then every n-th
            return
        samples = table_samples(_samples(pl_module), self.num_samples, self.unique_prompts)
        loggers = _wandb_loggers(trainer)
        if not samples or not loggers:
            return
        step = samples[0]["step"]  # the rollout step's index, as its metrics and trajectories.jsonl count it
        columns = table_columns(SAMPLE_COLUMNS, samples)
        rows = [[_cell(s, c) for c in columns] for s in samples]
        for logger in loggers:
            logger.log_table(key="samples", columns=columns, data=rows, step=step)

    def on_validation_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.eval_rows = []

    def on_validation_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if trainer.sanity_checking:
            return
        # the table's rows so far: the first rows (or prompts) of what came, so memory stays num_samples rows
        self.eval_rows = table_samples(self.eval_rows + _eval_samples(outputs), self.num_samples, self.unique_prompts)

    def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """An ``eval_samples`` table of the evaluation's first ``num_samples`` samples (or prompts), rank 0's."""
        samples, self.eval_rows = self.eval_rows, []
        loggers = _wandb_loggers(trainer)
        if not self.every_n_steps or not trainer.is_global_zero or not samples or not loggers:
            return
        columns = table_columns(EVAL_SAMPLE_COLUMNS, samples)
        rows = [[_cell(s, c) for c in columns] for s in samples]
        for logger in loggers:
            logger.log_table(
                key="eval_samples", columns=columns, data=rows, step=max(trainer.global_step - 1, 0)
            )  # where Lightning logs the eval metrics


class TrajectoryWriter(L.Callback):
    """Appends every rollout step's samples (prompt, completion, reward, advantage, ...) to
    ``<log_dir>/trajectories.jsonl`` and every evaluation's (prompt, completion, reward, correct, answer, ...) to
    ``<log_dir>/eval_trajectories.jsonl`` (rank r > 0 writes ``trajectories.rank<r>.jsonl``, ...)."""

    def __init__(self, enabled: bool = True, eval: bool = True) -> None:
        """
        Args:
            enabled: Write the files.
            eval: Write the evaluations' samples too (``eval_trajectories.jsonl``; ``trained_steps`` says after how
                many rollout steps each was sampled).
        """
        self.enabled = enabled
        self.eval = eval

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.append(trainer, "trajectories", _samples(pl_module))

    def on_validation_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.eval and not trainer.sanity_checking:
            self.append(trainer, "eval_trajectories", _eval_samples(outputs))

    def append(self, trainer: Any, name: str, rows: list[dict]) -> None:
        """Append ``rows`` to this rank's ``<log_dir>/<name>.jsonl``."""
        log_dir = trainer.log_dir
        if not self.enabled or not rows or not log_dir:
            return
        rank = trainer.global_rank
        path = Path(log_dir) / (f"{name}.jsonl" if rank == 0 else f"{name}.rank{rank}.jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")


class LoggerSaveConfigCallback(SaveConfigCallback):
    """Writes ``config.yaml`` to the log dir as LightningCLI does, and logs the full resolved config to every logger.

    A run that fails before writing anything (bad data found at setup, say) leaves no empty ``version_N`` behind:
    Lightning creates the loggers' directories before the data module's ``setup``, so they are removed again
    here when still empty.
    """

    def save_config(self, trainer: Any, pl_module: Any, stage: str) -> None:
        config = yaml.safe_load(self.parser.dump(self.config, skip_none=False))
        for logger in trainer.loggers:
            logger.log_hyperparams(config)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if trainer.global_rank != 0:
            return
        for logger in trainer.loggers:
            log_dir = getattr(logger, "log_dir", None)
            if log_dir and os.path.isdir(log_dir) and not any(files for _, _, files in os.walk(log_dir)):
                shutil.rmtree(log_dir, ignore_errors=True)  # only empty folders: nothing the run wrote is lost
