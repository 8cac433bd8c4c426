"""What a judger call gets besides the samples: TRL's ``trainer_state``, ``log_extra`` and ``log_metric`` keywords.

TRL's ``GRPOTrainer._calculate_rewards`` passes every reward function ``trainer_state`` (for curriculum rewards),
``log_extra(column, values)`` (extra columns of the completions table) and ``log_metric(name, value)`` (scalar
metrics, averaged per logging step). The :class:`~rlflow.judgers.runner.JudgerRunner` passes them too:
``trainer_state`` is the :class:`RunState` the :class:`~rlflow.data.experience_maker.ExperienceMaker` gives for the
rollout step (or evaluation) being judged; :class:`JudgerLogs` collects what the judgers log during one batch.

In multi-turn runs with environments (``data.multiturn.environment_factory``, TRL's contract, or an rlflow
``data.multiturn.environment``) a judger also gets ``environments``: the environment instances, one per completion
in completion order (:func:`environments_of`), as TRL 1.16 passes them; in other runs the keyword is absent. The
instances live in the trainer process, so a judger given them runs there, in a thread (never in a worker process).

A judger receives only the keywords it takes: all of them where it takes ``**kwargs`` (TRL's reward functions
do, and so do rlflow's own judgers), else those its signature names (:func:`accepted_keywords`).
"""

from __future__ import annotations

import inspect
import json
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunState:
    """The fields of TRL's ``transformers.TrainerState`` that have a meaning here (TRL's ``trainer_state``).

    ``global_step`` counts rollout steps, rlflow's one step unit (:mod:`rlflow.training.step_unit`): 0 while the
    first rollout step is judged, ``trainer.max_steps`` in all. TRL counts optimizer steps, of which one generation
    makes ``steps_per_generation``; a curriculum on ``global_step / max_steps`` reads the same either way.
    ``epoch`` is the fraction of passes over the prompts made so far (``global_step`` over the rollout steps of an
    epoch), ``num_train_epochs`` the passes the run makes. ``log_history`` stays empty (the metrics go to the
    loggers, not to the state). TrainerState's other fields are there with its defaults, so that a reward function
    reading one runs: they describe a ``transformers.Trainer``'s bookkeeping (logging, saving, hyper-parameter
    search), which rlflow does not have.
    """

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    num_train_epochs: int = 0
    is_world_process_zero: bool = True
    is_local_process_zero: bool = True
    log_history: list[dict[str, float]] = field(default_factory=list)
    logging_steps: int = 500
    eval_steps: int = 500
    save_steps: int = 500
    train_batch_size: int | None = None
    num_input_tokens_seen: int = 0
    total_flos: float = 0.0
    best_metric: float | None = None
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    is_hyper_param_search: bool = False
    trial_name: str | None = None
    trial_params: dict[str, Any] | None = None
    stateful_callbacks: dict[str, Any] = field(default_factory=dict)


def metric_value(name: Any, value: Any) -> float:
    """``log_metric(name, value)``'s value as a float (a number, a bool, a 0-d tensor or array), or a ValueError that
    says which call gave what."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"log_metric({str(name)!r}, ...) needs a number, got {type(value).__name__} "
                         f"{str(value)[:40]!r}") from None


def before_training() -> RunState:
    """The state judgers see outside a run (``rlflow data check``, a runner used on its own): step 0 of 1, so a
    curriculum on ``global_step / max_steps`` works there too."""
    return RunState(max_steps=1, num_train_epochs=1)


def run_state(step: int, max_steps: int, max_epochs: int | None, steps_per_epoch: int, rank: int = 0,
              local_rank: int | None = None) -> RunState:
    """The :class:`RunState` of rollout step ``step`` of a run bounded by ``trainer.max_steps`` (-1: unbounded)
    and ``trainer.max_epochs`` (None or -1: unbounded), with ``steps_per_epoch`` rollout steps per epoch."""
    per_epoch = max(steps_per_epoch, 1)
    epochs = max_epochs if max_epochs is not None and max_epochs > 0 else None
    if max_steps < 0:
        max_steps = epochs * per_epoch if epochs is not None else 0
    elif epochs is not None:
        max_steps = min(max_steps, epochs * per_epoch)
    return RunState(
        global_step=step, max_steps=max_steps, epoch=step / per_epoch,
        num_train_epochs=epochs if epochs is not None else math.ceil(max_steps / per_epoch),
        is_world_process_zero=rank == 0, is_local_process_zero=(rank if local_rank is None else local_rank) == 0,
    )


def environments_of(completions: Sequence[Any]) -> list[Any] | None:
    """TRL's ``environments``: each completion's environment instance (``Completion.info["environment"]``, set by the
    multi-turn rollout), in completion order; None where no completion has one (the keyword is not passed)."""
    found = [(getattr(c, "info", None) or {}).get("environment") for c in completions]
    return found if any(x is not None for x in found) else None


def accepted_keywords(fn: Callable[..., Any]) -> frozenset[str] | None:
    """The keyword arguments ``fn`` takes; None where it takes any (``**kwargs``) or its signature cannot be read."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable without a signature: give it everything
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def required_keywords(fn: Callable[..., Any]) -> frozenset[str]:
    """The parameters ``fn`` cannot be called without (no default), by name; none where its signature cannot be
    read."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in params
                     if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty)


def select_keywords(kwargs: dict[str, Any], accepted: frozenset[str] | None) -> dict[str, Any]:
    """``kwargs`` limited to the ``accepted`` names (all of them where ``accepted`` is None)."""
    return kwargs if accepted is None else {key: value for key, value in kwargs.items() if key in accepted}


def plain(value: Any) -> Any:
    """``value`` where it is JSON (``trajectories.jsonl`` writes it), else its ``str``."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return str(value)
    return value


class JudgerLogs:
    """What the judgers of one batch of ``n`` samples log: ``log_extra`` columns per sample (None where a column was
    not logged for it) and ``log_metric`` values in the order they came.

    :meth:`keywords` makes one call's ``log_extra``/``log_metric``: the call's values are put at its samples'
    positions in the batch (``positions``). A ``log_extra`` with the wrong number of values, or a metric that is
    not a number, raises inside the judger: a failure of that judger's call. Once :meth:`close` d (the batch is
    judged), a late call from a judger abandoned after its timeout changes nothing.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.extra: dict[str, list[Any]] = {}
        self.metrics: dict[str, list[float]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def close(self) -> None:
        """Take no more values: the batch's result holds these."""
        with self._lock:
            self._closed = True

    def keywords(self, positions: Sequence[int], state: RunState) -> dict[str, Any]:
        """``trainer_state``, ``log_extra`` and ``log_metric`` for a call judging the samples at ``positions``."""

        def log_extra(column: str, values: Sequence[Any]) -> None:
            values = list(values)
            if len(values) != len(positions):
                raise ValueError(f"log_extra({column!r}, values) got {len(values)} values for the call's "
                                 f"{len(positions)} completions (one per completion)")
            values = [plain(value) for value in values]
            with self._lock:
                if self._closed:
                    return
                logged = self.extra.setdefault(str(column), [None] * self.n)
                for i, value in zip(positions, values):
                    logged[i] = value

        def log_metric(name: str, value: float) -> None:
            value = metric_value(name, value)
            with self._lock:
                if not self._closed:
                    self.metrics.setdefault(str(name), []).append(value)

        return {"trainer_state": state, "log_extra": log_extra, "log_metric": log_metric}
