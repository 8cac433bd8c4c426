"""Scores a batch of completions: routes each sample to its data source's judgers and combines their rewards.

Routing follows XTuner's ``JudgerConfig``: ``{"openai/gsm8k": "gsm8k"}`` maps a ``data_source`` to one judger
or a list of them; the key ``"*"`` catches every source without its own entry. Several judgers on one sample
are summed with ``reward_weights`` (default 1.0), skipping ``None`` ("not applicable") as TRL's NaN-aware sum
does; a sample no judger scored gets 0.0 and is counted in ``judger/unscored``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from rlflow import registry

GROUP = "rlflow.judgers"


def judger_name(spec: Any, judger: Any) -> str:
    """The metric name of a judger: its short name, its ``name`` attribute, or its function name."""
    if isinstance(spec, str):
        return spec
    name = getattr(judger, "name", None)
    if isinstance(name, str) and name not in ("", "judger"):
        return name
    if isinstance(spec, dict):
        return str(spec["class_path"]).replace(":", ".").rsplit(".", 1)[-1]
    return getattr(judger, "__name__", type(judger).__name__)


@dataclass
class JudgeResult:
    """Rewards of one batch: the combined reward per sample and each judger's own (None where not applied)."""

    rewards: list[float]
    per_judger: dict[str, list[float | None]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


class JudgerRunner:
    """Builds the judgers named in the config once and applies them to batches."""

    def __init__(
        self,
        judgers: dict[str, Any],
        reward_weights: dict[str, float] | None = None,
    ) -> None:
        if not judgers:
            raise ValueError(
                "data.judgers is empty: map each data_source to a judger, e.g. {'openai/gsm8k': 'gsm8k'}; "
                f"available judgers: {', '.join(registry.available(GROUP))}"
            )
        self.routes: dict[str, list[str]] = {}
        self.judgers: dict[str, Callable[..., Sequence[float | None]]] = {}
        for source, specs in judgers.items():
            specs = specs if isinstance(specs, (list, tuple)) else [specs]
            names = []
            for spec in specs:
                judger = registry.build(GROUP, spec)
                name = judger_name(spec, judger)
                self.judgers.setdefault(name, judger)
                names.append(name)
            self.routes[source] = names
        self.weights = {name: 1.0 for name in self.judgers}
        for name, weight in (reward_weights or {}).items():
            if name not in self.weights:
                raise ValueError(f"reward_weights names judger {name!r}, which is not configured; judgers: {sorted(self.weights)}")
            self.weights[name] = float(weight)

    def route(self, data_source: str | None) -> list[str]:
        names = self.routes.get(data_source or "", self.routes.get("*"))
        if names is None:
            raise KeyError(
                f"no judger for data_source {data_source!r}; data.judgers routes: {sorted(self.routes)} "
                "(add the source, or a '*' entry for every source)"
            )
        return names

    def call_judger(self, name: str, kwargs: dict[str, Any], n: int) -> list[float | None]:
        """Call one judger on a sub-batch of ``n`` samples and check what it returns."""
        out = self.judgers[name](**kwargs)
        if out is None:
            return [None] * n
        out = list(out)
        if len(out) != n:
            raise ValueError(f"judger {name!r} returned {len(out)} rewards for {n} completions")
        for value in out:
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise TypeError(f"judger {name!r} returned {value!r} ({type(value).__name__}); rewards must be numbers or None")
        return [None if v is None else float(v) for v in out]

    def judge(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        columns: dict[str, Sequence[Any]],
    ) -> JudgeResult:
        n = len(completions)
        sources = columns.get("data_source") or [None] * n
        per_judger: dict[str, list[float | None]] = {name: [None] * n for name in self.judgers}
        for name in self.judgers:
            idx = [i for i in range(n) if name in self.route(sources[i])]
            if not idx:
                continue
            kwargs = {
                "prompts": [prompts[i] for i in idx],
                "completions": [completions[i] for i in idx],
                "completion_ids": [completion_ids[i] for i in idx],
                **{key: [values[i] for i in idx] for key, values in columns.items()},
            }
            for i, value in zip(idx, self.call_judger(name, kwargs, len(idx))):
                per_judger[name][i] = value
        rewards, unscored = [], 0
        for i in range(n):
            parts = [self.weights[name] * per_judger[name][i] for name in self.judgers if per_judger[name][i] is not None]
            parts = [p for p in parts if not math.isnan(p)]
            unscored += not parts
            rewards.append(sum(parts) if parts else 0.0)
        metrics = {"judger/unscored": float(unscored)}
        for name, values in per_judger.items():
            scored = [v for v in values if v is not None]
            if scored:
                mean = sum(scored) / len(scored)
                std = math.sqrt(sum((v - mean) ** 2 for v in scored) / max(len(scored) - 1, 1))
                metrics[f"rewards/{name}/mean"] = mean
                metrics[f"rewards/{name}/std"] = std
        return JudgeResult(rewards, per_judger, metrics)
