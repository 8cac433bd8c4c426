"""The replay buffer between rollout and training.

Rollout puts judged experiences in; training takes them out as mini-batches, one per optimizer step. On-policy
GRPO drains the buffer every rollout step, so it never holds stale data; ``max_size`` bounds it for off-policy
plugins. Its contents are part of a checkpoint.
"""

from __future__ import annotations

import random
from typing import Any

from rlflow.data.experience import Experience


class ReplayBuffer:
    """A FIFO of :class:`Experience` that hands out shuffled, evenly sized mini-batches."""

    def __init__(self, max_size: int | None = None, seed: int = 0) -> None:
        self.max_size = max_size
        self.items: list[Experience] = []
        self.rng = random.Random(seed)

    def __len__(self) -> int:
        return len(self.items)

    def add(self, experiences: list[Experience]) -> None:
        self.items.extend(experiences)
        if self.max_size is not None and len(self.items) > self.max_size:
            del self.items[: len(self.items) - self.max_size]

    def drain(self, num_minibatches: int, shuffle: bool = True) -> list[list[Experience]]:
        """Empty the buffer into ``num_minibatches`` mini-batches of near-equal size."""
        items, self.items = self.items, []
        if num_minibatches < 1:
            raise ValueError(f"num_minibatches must be >= 1, got {num_minibatches}")
        if len(items) < num_minibatches:
            raise ValueError(f"{len(items)} experiences cannot fill {num_minibatches} mini-batches")
        if shuffle:
            self.rng.shuffle(items)
        size, rest = divmod(len(items), num_minibatches)
        out, start = [], 0
        for i in range(num_minibatches):
            end = start + size + (i < rest)
            out.append(items[start:end])
            start = end
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"items": list(self.items), "rng": self.rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.items = list(state["items"])
        self.rng.setstate(state["rng"])
