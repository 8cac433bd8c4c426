"""``overlong``: DAPO's soft overlong punishment (Eq. 13 of arXiv:2503.14476), from completion token counts.

With ``L_max = max_tokens`` and ``L_cache = buffer_tokens``, a completion of ``|y|`` tokens gets::

    0                                         if |y| <= L_max - L_cache
    ((L_max - L_cache) - |y|) / L_cache       if L_max - L_cache < |y| <= L_max
    -1                                        if |y| > L_max

times ``penalty_factor`` (verl's ``overlong_penalty_factor``). It is meant to be added to a correctness
judger (list both on a route). ``max_tokens`` defaults to ``data.sampling.max_tokens``; counts come from the
``completion_ids`` keyword TRL passes to every reward function.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlflow.judgers.base import Judger


class OverlongJudger(Judger):
    """Penalises completions that run into the last ``buffer_tokens`` of the generation budget.

    Args:
        buffer_tokens: Length of the soft-punishment zone before ``max_tokens`` (DAPO's ``L_cache``); default a fifth
            of ``max_tokens`` (DAPO's 4096 of 20480).
        max_tokens: The generation budget ``L_max``; filled from ``data.sampling.max_tokens`` when not set.
        penalty_factor: Scale of the penalty (the reward at or over ``max_tokens`` is ``-penalty_factor``).
    """

    name = "overlong"

    def __init__(
        self, buffer_tokens: int | None = None, max_tokens: int | None = None, penalty_factor: float = 1.0
    ) -> None:
        if max_tokens is None:
            raise ValueError(
                "the overlong judger needs max_tokens (set init_args.max_tokens or data.sampling.max_tokens)"
            )
        if buffer_tokens is None:
            buffer_tokens = max(1, max_tokens // 5)
        if not 0 < buffer_tokens <= max_tokens:
            raise ValueError(f"overlong: buffer_tokens={buffer_tokens} must be in (0, max_tokens={max_tokens}]")
        self.buffer_tokens = int(buffer_tokens)
        self.max_tokens = int(max_tokens)
        self.penalty_factor = float(penalty_factor)

    def penalty(self, length: int) -> float:
        """The penalty of one completion of ``length`` tokens."""
        expected = self.max_tokens - self.buffer_tokens
        if length <= expected:
            return 0.0
        if length <= self.max_tokens:
            return (expected - length) / self.buffer_tokens * self.penalty_factor
        return -self.penalty_factor

    def __call__(self, completion_ids: Sequence[Sequence[int]] | None = None, **_: Any) -> list[float]:
        if completion_ids is None:
            raise ValueError("the overlong judger needs the completion_ids keyword (token ids of each completion)")
        return [self.penalty(len(ids)) for ids in completion_ids]
