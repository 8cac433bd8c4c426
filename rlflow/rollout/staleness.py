"""The staleness bound of pipelined GRPO, enforced in one place and measured on every rollout step.

With ``data.pipeline.max_staleness: N`` (> 0) completions are generated ahead of training
(:mod:`rlflow.rollout.pipeline`),
so the weights that sampled an experience (its ``policy_version`` stamp) can be older than the weights that
start training on it. The *staleness* of an experience is ``trained_version - policy_version``, where
``trained_version`` is the policy version (optimizer steps taken) when its rollout step starts updating. The
optimizer steps *inside* a rollout step (``model.update.optimizer_steps`` > 1, ``num_iterations`` > 1) are not counted:
the strictly on-policy loop has them too, and the ratio against the old log-probs already handles them, so
today's loop has staleness 0 by this definition.

:class:`StalenessGate` is the only place that decides: every experience of a step passes through
:meth:`StalenessGate.check`, which measures ``sampling/staleness/mean|max`` and splits the groups into those
within the bound and those beyond it; what happens to the latter is ``data.pipeline.stale_policy``: ``drop`` (removed
and counted in ``sampling/staleness/dropped_groups``) or ``regenerate`` (sampled again from the current
weights, counted in ``sampling/staleness/regenerated_groups``). Simplification: a group is judged by its
oldest completion (a group is sampled by one job, so its completions share a version anyway).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rlflow.config_error import ConfigError

POLICIES = ("drop", "regenerate")


@dataclass
class GateResult:
    """What :meth:`StalenessGate.check` decided for one rollout step's groups."""

    stale: list[int]  # indices of the groups beyond it (to drop or regenerate, by policy)
    metrics: dict[str, float] = field(default_factory=dict)


class StalenessGate:
    """Admits an experience to training only while ``trained_version - policy_version <= max_staleness``.

    Args:
        max_staleness: The bound N, in policy versions (optimizer steps); 0 is strictly on-policy.
        policy: What happens to groups beyond the bound: ``drop`` or ``regenerate``.
    """

    def __init__(self, max_staleness: int = 0, policy: str = "regenerate") -> None:
        if not isinstance(max_staleness, int) or isinstance(max_staleness, bool) or max_staleness < 0:
            raise ConfigError(f"data.pipeline.max_staleness must be an integer >= 0, got {max_staleness!r}")
        if policy not in POLICIES:
            raise ConfigError(f"data.pipeline.stale_policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.max_staleness = max_staleness
        self.policy = policy
        self.dropped_groups = 0  # over the run (checkpointed by the pipeline)
        self.regenerated_groups = 0

    def check(self, group_versions: Sequence[int], trained_version: int) -> GateResult:
        """Split groups (each given by its sampling version) by the bound; measure the staleness of the groups
        admitted. Raises if a version is newer than ``trained_version`` (a stamp from the future is a bug)."""
        staleness = [trained_version - v for v in group_versions]
        if any(s < 0 for s in staleness):
            raise RuntimeError(
                f"experience stamped with policy versions {sorted(set(group_versions))} is newer than "
                f"the weights about to train on it (version {trained_version})"
            )
        stale = [i for i, s in enumerate(staleness) if s > self.max_staleness]
        return GateResult(stale, self.measure([s for s in staleness if s <= self.max_staleness]))

    def measure(self, staleness: Sequence[int]) -> dict[str, float]:
        """``sampling/staleness/mean|max`` of what trains (and the run's counters)."""
        return {
            "sampling/staleness/mean": sum(staleness) / len(staleness) if staleness else 0.0,
            "sampling/staleness/max": float(max(staleness)) if staleness else 0.0,
            "sampling/staleness/dropped_groups": float(self.dropped_groups),
            "sampling/staleness/regenerated_groups": float(self.regenerated_groups),
        }

    def state_dict(self) -> dict[str, int]:
        return {"dropped_groups": self.dropped_groups, "regenerated_groups": self.regenerated_groups}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.dropped_groups = int(state.get("dropped_groups", 0))
        self.regenerated_groups = int(state.get("regenerated_groups", 0))
