"""``env_reward``: the reward a multi-turn environment gave the trajectory, as a judger.

An environment (:mod:`rlflow.environments.base`) may return a reward after each model turn; the multi-turn
rollout sums them into the sample's ``env_reward`` column. This judger passes that sum on (``None`` where the
environment gave none, so it is skipped in the weighted sum like any "not applicable" reward). Combine it with
other judgers in ``data.judging.judgers`` as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def env_reward(completions: Sequence[Any], env_reward: Sequence[float | None] | None = None,
               **_: Any) -> list[float | None]:
    """The environment's summed reward of each trajectory (None where there is none)."""
    if env_reward is None:
        return [None] * len(completions)
    return [None if r is None else float(r) for r in env_reward]
