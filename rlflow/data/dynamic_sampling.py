"""DAPO's dynamic sampling: drop groups whose rewards all agree, draw more prompts until the batch is full.

A group whose ``k`` rewards are equal has zero advantage everywhere: it costs a forward and backward pass and
teaches nothing. :class:`DynamicSampling` keeps the groups whose rewards differ and asks for more rounds of
generation (on prompts drawn at random from the training set, seeded by ``seed``, the rollout step, the round and
the rank, so a resumed run draws the same ones) until the batch is full or ``max_rounds`` rounds have run.
Every rank runs the same number of rounds (a rank whose batch is full keeps sampling while another's is short),
and the batch keeps its size, since ranks must take the same number of optimizer steps: a batch still short after
the last round is topped up with dropped groups, which carry advantage 0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Groups:
    """One round's judged groups, flattened in prompt order (``k`` completions per record)."""

    records: list[Any]
    completions: list[Any]
    rewards: list[float]
    texts: list[str]
    failed: list[tuple[str, ...]] | None = None  # per sample, the judgers that failed on it (JudgeResult.failed)

    def group(self, g: int, k: int) -> tuple[Any, list[Any], list[float], list[str], list[tuple[str, ...]]]:
        part = slice(g * k, (g + 1) * k)
        failed = self.failed[part] if self.failed else [()] * k
        return self.records[g], self.completions[part], self.rewards[part], self.texts[part], failed

    @classmethod
    def join(cls, groups: list[tuple[Any, list[Any], list[float], list[str], list[tuple[str, ...]]]]) -> Groups:
        return cls([g[0] for g in groups], [c for g in groups for c in g[1]], [r for g in groups for r in g[2]],
                   [t for g in groups for t in g[3]], [f for g in groups for f in g[4]])


class DynamicSampling:
    """Fills a rollout batch with groups that carry a learning signal.

    Args:
        max_rounds: Most generation rounds per rollout step, the first included.
        seed: Run seed; extra draws use (seed, step, round, rank).
    """

    def __init__(self, max_rounds: int = 3, seed: int = 0) -> None:
        if max_rounds < 1:
            raise ValueError(f"data.filtering.max_rounds must be >= 1, got {max_rounds}")
        self.max_rounds = max_rounds
        self.seed = seed

    def draw_seed(self, step: int, round_: int, rank: int) -> int:
        return self.seed + 7919 * (step + 1) + 104729 * round_ + 1299709 * rank

    def fill(self, first: Groups, k: int, step: int, rank: int, num_prompts: int,
             regenerate: Callable[[list[int], torch.Generator], Groups],
             any_short: Callable[[bool], bool] = lambda short: short) -> tuple[Groups, dict[str, float], float]:
        """Keep informative groups of ``first`` and regenerate until the batch is full.

        ``regenerate(indices, generator)`` generates and judges the training prompts at ``indices``;
        ``any_short(short)`` is true when any rank's batch is still short (a collective under data parallelism).
        Returns the chosen groups, the ``sampling/*`` metrics and the seconds spent generating extra rounds.
        """
        target = len(first.records)
        kept: list[tuple] = []
        dropped: list[tuple] = []
        current, rounds, drawn, extra_time = first, 0, 0, 0.0
        while True:
            rounds += 1
            drawn += len(current.records)
            for g in range(len(current.records)):
                group = current.group(g, k)
                (kept if max(group[2]) - min(group[2]) > 1e-6 else dropped).append(group)
            if not any_short(len(kept) < target) or rounds >= self.max_rounds:
                break
            gen = torch.Generator().manual_seed(self.draw_seed(step, rounds, rank))
            indices = torch.randint(num_prompts, (target,), generator=gen).tolist()
            t0 = time.perf_counter()
            current = regenerate(indices, gen)
            extra_time += time.perf_counter() - t0
        padded = max(target - len(kept), 0)
        metrics = {
            "sampling/rounds": float(rounds), "sampling/groups_drawn": float(drawn),
            "sampling/groups_dropped": float(len(dropped)), "sampling/groups_padded": float(padded),
        }
        return Groups.join(kept[:target] + dropped[:padded]), metrics, extra_time
