"""Evaluation metrics: accuracy and pass@k over the eval set, overall and per ``data_source``.

As XTuner's evaluator does, every eval prompt is generated (greedily by default, or ``k`` samples at
``data.eval_temperature``), judged by the same judgers as training, and a completion counts as correct when its
reward reaches ``data.eval_pass_threshold``. Reported: ``eval/accuracy`` (the mean over all samples, i.e. the
unbiased pass@1), ``eval/pass@k`` (the unbiased estimator of Chen et al. 2021, "Evaluating Large Language
Models Trained on Code": ``1 - C(n - c, k) / C(n, k)`` per prompt with ``n`` samples of which ``c`` are
correct), ``eval/reward``, ``eval/mean_length``, and ``eval/<data_source>/<metric>`` for every source.

Evaluation sampling runs under its own seed, on a forked RNG, so evaluating never changes the random stream of
training: a run with evaluation resumes exactly, and the same weights always get the same score.

Simplifications: every rank evaluates the prompts its eval loader gives it and logs its own result.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from typing import Any, Iterator

import torch


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` samples drawn without replacement from ``n`` (``c`` correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):  # C(n-c, k) / C(n, k) as a running product, numerically stable
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


@contextlib.contextmanager
def isolated_rng(seed: int) -> Iterator[None]:
    """Run a block with every torch generator seeded to ``seed``, then put the previous states back."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


class EvalAccumulator:
    """Collects judged eval samples batch by batch and turns them into the ``eval/*`` metrics."""

    def __init__(self, k: int = 1) -> None:
        """
        Args:
            k: Samples per prompt; pass@k is reported when it is above 1.
        """
        self.k = k
        self.prompts: list[tuple[str, list[bool], list[float], list[int]]] = []

    def add(self, data_sources: list[str | None], correct: list[list[bool]], rewards: list[list[float]],
            lengths: list[list[int]]) -> None:
        """Add one batch: per prompt, its source and the correctness, reward and length of each of its samples."""
        for source, c, r, n in zip(data_sources, correct, rewards, lengths, strict=True):
            self.prompts.append((source or "unknown", list(c), list(r), list(n)))

    def compute(self) -> dict[str, float]:
        """``eval/accuracy``, ``eval/pass@k``, ``eval/reward``, ``eval/mean_length``, overall and per source."""
        groups: dict[str, list] = defaultdict(list)
        for item in self.prompts:
            groups[item[0]].append(item)
        metrics = self._metrics(self.prompts, "eval")
        if len(groups) > 1 or (groups and next(iter(groups)) != "unknown"):
            for source, items in sorted(groups.items()):
                metrics.update(self._metrics(items, f"eval/{source}"))
        return metrics

    def _metrics(self, items: list, prefix: str) -> dict[str, float]:
        if not items:
            return {}
        samples = [(c, r, n) for _, cs, rs, ns in items for c, r, n in zip(cs, rs, ns)]
        out = {
            f"{prefix}/accuracy": sum(c for c, _, _ in samples) / len(samples),
            f"{prefix}/reward": sum(r for _, r, _ in samples) / len(samples),
            f"{prefix}/mean_length": sum(n for _, _, n in samples) / len(samples),
        }
        if self.k > 1:
            out[f"{prefix}/pass@{self.k}"] = sum(pass_at_k(len(cs), sum(cs), self.k) for _, cs, _, _ in items) / len(items)
        return out


def eval_seed(seed: int, step: int, batch_idx: int) -> int:
    """The seed of one eval batch: fixed by the run seed, the training step and the batch."""
    return (seed * 1_000_003 + step * 10_007 + batch_idx) % (2**63 - 1)

