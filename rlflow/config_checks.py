"""Configuration checks: every invalid value becomes one :class:`ConfigError` that names its option.

The checks run where the values are defined: each settings group (``data.sampling``, ``model.optim``, ...)
checks its fields when it is built, and the classes check their top-level arguments, so through the CLI a wrong
value fails before any model or data is loaded, and ``rlflow.cli.main`` prints it as one ``rlflow: error:``
line (``data.sampling.max_tokens must be >= 1, got 0``). This module holds the rules and imports nothing heavy:
losses, samplers and the data tools may all use it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from rlflow.config_error import ConfigError
from rlflow.models.model_path import check_model_path

__all__ = ["ConfigError", "SettingsGroup", "check_batch_split", "check_data_args", "check_multiturn_images",
           "check_rank_share", "check_values"]


Rule = Callable[[str, Any], None]


def at_least(low: float, optional: bool = False) -> Rule:
    """``value >= low`` (and, with ``optional``, None is accepted too)."""

    def check(key: str, value: Any) -> None:
        if value is None and optional:
            return
        if not _is_number(value) or value < low:
            raise ConfigError(f"{key} must be >= {low}, got {value!r}")

    return check


def greater_than(low: float, optional: bool = False) -> Rule:
    """``value > low`` (and, with ``optional``, None is accepted too)."""

    def check(key: str, value: Any) -> None:
        if value is None and optional:
            return
        if not _is_number(value) or value <= low:
            raise ConfigError(f"{key} must be > {low}, got {value!r}")

    return check


def interval(low: float, high: float, low_open: bool = False, high_open: bool = False, optional: bool = False) -> Rule:
    """``value`` in the interval from ``low`` to ``high``, each end closed unless told otherwise."""
    text = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"

    def check(key: str, value: Any) -> None:
        if value is None and optional:
            return
        ok = _is_number(value) and (value > low if low_open else value >= low) and (
            value < high if high_open else value <= high)
        if not ok:
            raise ConfigError(f"{key} must be in {text}, got {value!r}")

    return check


def one_of(*choices: Any, optional: bool = False) -> Rule:
    """``value`` is one of ``choices``."""

    def check(key: str, value: Any) -> None:
        if value is None and optional:
            return
        if value not in choices:
            raise ConfigError(f"{key} must be one of {', '.join(map(str, choices))}, got {value!r}")

    return check


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def check_values(prefix: str, rules: Mapping[str, Rule], values: Mapping[str, Any]) -> None:
    """Apply each rule to the value of the same name in ``values`` (absent names are skipped).

    ``prefix`` is the config section (``data``, ``model``) the error message puts before the name.
    """
    for name, rule in rules.items():
        if name in values:
            rule(f"{prefix}.{name}", values[name])


def _group_of_two(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 2:
        raise ConfigError(
            f"{key} must be >= 2, got {value!r}: GRPO compares the completions of one prompt with each other, so a "
            "group needs at least 2 (a group of 1 has no mean or std to compare against)"
        )


DATA_RULES: dict[str, Rule] = {
    "prompt_repeat_k": _group_of_two,
    "global_batch_size": at_least(1),
    "max_prompt_length": at_least(1),
}

def check_data_args(values: Mapping[str, Any]) -> None:
    """Check the top-level ``data.*`` arguments of ``RolloutDataModule.__init__`` (pass its ``locals()``; each group
    of settings checks its own); ConfigError on the first bad one.

    Includes ``tokenizer_path`` (see :mod:`rlflow.models.model_path`), so a wrong path fails before any slow load.
    """
    check_values("data", DATA_RULES, values)
    if values.get("tokenizer_path"):
        check_model_path(values["tokenizer_path"], "data.tokenizer_path")


def check_multiturn_images(images: bool, multiturn: bool) -> None:
    """Refuse prompts with images in multi-turn rollouts (``data.multiturn.tools``, ``.environment`` or
    ``.environment_factory``).

    A multi-turn rollout generates every turn from the conversation's token ids alone (an environment may even
    write the first prompt itself), so the model would sample without the images it is then trained with.
    ``images``: whether any training or evaluation prompt has images; ``multiturn``: whether rollouts are multi-turn.
    """
    if images and multiturn:
        raise ConfigError("prompts with images are not rolled out multi-turn: data.multiturn.tools, "
                          "data.multiturn.environment and data.multiturn.environment_factory generate each turn from "
                          "the text alone, without the images; unset them for this data, or use prompts without "
                          "images")


@dataclass(frozen=True)
class SettingsGroup:
    """What every settings group shares: its key in the config, its value rules, and :meth:`coerce`. (A
    dataclass without fields: jsonargparse shows a dataclass whose bases are all dataclasses as a group of
    options, ``--model.optim.lr``.)"""

    #: The group's full key (``model.optim``): the prefix of its error messages.
    key: ClassVar[str] = "model"
    #: Rules (:mod:`rlflow.config_checks`) applied to the fields of the same names.
    rules: ClassVar[dict[str, Rule]] = {}

    def __post_init__(self) -> None:
        check_values(self.key, self.rules, self.as_dict())
        self.check()

    def check(self) -> None:
        """Checks that involve more than one field (none by default)."""

    def as_dict(self) -> dict[str, Any]:
        """The fields as plain data (what checkpoints hold)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def coerce(cls, value: Any) -> Any:
        """``value`` as settings: a settings object, a mapping of its fields (the Python API, a checkpoint's
        hyper-parameters), or None for the defaults."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            names = [f.name for f in dataclasses.fields(cls)]
            unknown = sorted(set(value) - set(names))
            if unknown:
                raise ConfigError(f"{cls.key} has no option {unknown[0]!r}; its options are {', '.join(names)}")
            return cls(**value)
        raise ConfigError(f"{cls.key} must be a mapping of {cls.__name__} fields, got {type(value).__name__}")


def check_rank_share(global_batch_size: int, world_size: int) -> None:
    """Each of ``world_size`` ranks samples an equal share of a rollout step's prompts (one ConfigError line
    otherwise)."""
    if global_batch_size % world_size:
        raise ConfigError(f"data.global_batch_size={global_batch_size} must be a multiple of the {world_size} ranks "
                          "(trainer.devices x trainer.num_nodes)")


def check_batch_split(global_batch_size: int, k: int, optimizer_steps: int, world_size: int) -> None:
    """Before any rank starts: each rank samples an equal share of a rollout step's prompts, and each rank's
    completions fill ``optimizer_steps`` mini-batches (one optimizer step each). One ConfigError line otherwise."""
    check_rank_share(global_batch_size, world_size)
    per_rank = global_batch_size // world_size * k
    if optimizer_steps > per_rank:
        ranks = f" / {world_size} ranks" if world_size > 1 else ""
        raise ConfigError(f"model.update.optimizer_steps={optimizer_steps} needs at least one completion per "
                          f"optimizer step, and a rollout step gives {per_rank} (data.global_batch_size="
                          f"{global_batch_size}{ranks} x data.prompt_repeat_k={k}); lower it to at most {per_rank}")
