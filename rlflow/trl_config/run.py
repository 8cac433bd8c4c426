"""A TRL config as TRL runs it: the file's values over TRL's defaults, with the batch arithmetic of
``GRPOConfig.__post_init__`` that the conversion needs.

Values are read as TRL's parser reads them: a number written as a string (``"1e-6"``) is a number where the
field is one, a dictionary written as JSON text is a dictionary. TRL counts steps in optimizer steps, rlflow in
rollout steps (one generation and the optimizer steps taken on it), so :meth:`TrlRun.rollout_steps` converts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class NotConverted(Exception):
    """A value with no mechanical rlflow counterpart; the message says why (a comment at the top of the output)."""


class RefusedByTRL(ValueError):
    """Values TRL itself refuses to run with: the conversion stops with one line (:func:`convert` names the file)."""


def _number(value: Any, kind: type) -> Any:
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ValueError(f"{value!r} is not a number") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{value!r} is not a number")
    if kind is int:
        if value != int(value):
            raise ValueError(f"{value!r} is not a whole number")
        return int(value)
    return float(value)


def coerce(value: Any, kind: type | None) -> Any:
    """``value`` as TRL's parser gives a field of type ``kind`` (None, the default of optional fields, stays None;
    ``kind`` None or ``object``: as it is); ValueError if it cannot be one."""
    if value is None or kind is None or kind is object:
        return value
    if kind in (int, float):
        return _number(value, kind)
    if kind is bool:
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        if not isinstance(value, bool):
            raise ValueError(f"{value!r} is not true or false")
        return value
    if kind is dict:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise ValueError(f"{value!r} is not a mapping (nor JSON text of one)") from None
        if not isinstance(value, dict):
            raise ValueError(f"{value!r} is not a mapping")
        return value
    if kind is list:
        return [value] if isinstance(value, (str, int, float)) else list(value)
    if kind is str:
        if isinstance(value, (dict, list)):
            raise ValueError(f"{value!r} is not text")
        return str(value)
    raise TypeError(f"no coercion to {kind}")


@dataclass
class TrlRun:
    """The values a TRL run uses: those given in the file over ``defaults``, and what ``GRPOConfig`` derives from
    them. ``processes``: the number of training processes TRL was launched with (its batch sizes are per
    device)."""

    given: dict[str, Any]
    defaults: Mapping[str, Any]
    processes: int = 1

    def __getitem__(self, name: str) -> Any:
        return self.given[name] if name in self.given else self.defaults[name]

    def is_set(self, name: str) -> bool:
        """Whether the file gives ``name``."""
        return name in self.given

    def steps_per_generation(self) -> int:
        """Micro-batches per generation (``GRPOConfig``'s ``steps_per_generation``, derived where unset)."""
        steps, completions = self["steps_per_generation"], self["generation_batch_size"]
        per_step = self["per_device_train_batch_size"] * self.processes
        if steps is not None and completions is not None:
            raise RefusedByTRL("generation_batch_size and steps_per_generation are both set, which TRL refuses")
        if completions is not None:
            if completions % per_step:
                raise RefusedByTRL(f"generation_batch_size={completions} is not a multiple of "
                                   f"per_device_train_batch_size x processes = {per_step}, which TRL refuses")
            return completions // per_step
        return steps if steps is not None else self["gradient_accumulation_steps"]

    def prompts_per_step(self) -> int:
        """Prompts per generation, over all processes (rlflow's ``data.global_batch_size``)."""
        completions = self["per_device_train_batch_size"] * self.processes * self.steps_per_generation()
        k = self["num_generations"]
        if completions % k:
            raise RefusedByTRL(f"the generation batch of {completions} completions is not a multiple of "
                               f"num_generations={k}, which TRL refuses")
        return completions // k

    def optimizer_steps(self) -> int:
        """Optimizer steps per generation and pass (rlflow's ``model.update.optimizer_steps``)."""
        steps, accumulation = self.steps_per_generation(), self["gradient_accumulation_steps"]
        if steps % accumulation:
            raise NotConverted(f"steps_per_generation={steps} is not a multiple of gradient_accumulation_steps="
                               f"{accumulation}: TRL's optimizer steps straddle generations, rlflow takes whole "
                               "optimizer steps on each rollout step (model.update.optimizer_steps)")
        return steps // accumulation

    def rollout_steps(self, optimizer_steps: float) -> int:
        """``optimizer_steps`` (TRL's unit) in rollout steps (rlflow's), rounded up."""
        per_rollout = self.optimizer_steps() * self["num_iterations"]
        return max(1, math.ceil(optimizer_steps / per_rollout))

    @property
    def evaluating(self) -> bool:
        """Whether TRL evaluates during training."""
        return str(self["eval_strategy"]) != "no"
