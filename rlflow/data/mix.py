"""A weighted mix of prompt sources: every rollout step takes each source's share of the batch.

Source ``i`` with weight ``w_i`` has a quota of ``q_i = batch_size * w_i / sum(w)`` prompts per step. Each step
gives every source ``floor(q_i)`` prompts and hands the remaining slots to the sources with the most unpaid
fractional credit (ties to the earlier source), so a source gets ``floor(q_i)`` or ``ceil(q_i)`` prompts every
step and its running total stays within one prompt of ``step * q_i``: shares match the weights on every window,
not only on average. The arithmetic is exact (fractions), so the sequence never drifts.

Within a source, prompts come in a seeded permutation; when a source runs out it starts its next epoch with a
fresh permutation (``seed``, source, epoch), independently of the others, so a small source is repeated and a
large one is partly used, as the weights ask. Nothing is random but the seeded permutations and the
in-batch order, so every rank draws the same batches. Lightning's epochs only cut this stream into
``len(sampler)`` steps. Simplification: the quotas are fixed for the run (no curriculum schedule).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from fractions import Fraction
from typing import Any

import numpy as np
from torch.utils.data import Sampler


def _seed(*parts: int) -> list[int]:
    return [int(p) & 0xFFFFFFFF for p in parts]


class MixBatchSampler(Sampler[list[int]]):
    """Yields batches of indices into the concatenated records of several sources, in the configured shares.

    Args:
        sizes: Number of prompts of each source; the records are concatenated in this order.
        weights: Relative share of each source per batch (positive; normalised).
        batch_size: Prompts per rollout step, over all ranks.
        seed: Seed of every permutation and in-batch order.
        names: Source names, for messages and :meth:`shares`.
    """

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], batch_size: int, seed: int = 0,
                 names: Sequence[str] | None = None) -> None:
        if len(sizes) != len(weights) or not sizes:
            raise ValueError(f"need one weight per source, got {len(sizes)} sources and {len(weights)} weights")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.names = list(names) if names is not None else [f"source{i}" for i in range(len(sizes))]
        for name, size, w in zip(self.names, sizes, weights):
            if size < 1:
                raise ValueError(f"source {name!r} has no usable prompts")
            if not (w > 0 and math.isfinite(w)):
                raise ValueError(f"source {name!r}: weight must be a positive number, got {w!r}")
        self.sizes = [int(s) for s in sizes]
        self.weights = [float(w) for w in weights]
        self.batch_size = batch_size
        self.seed = seed
        self.offsets = [sum(self.sizes[:i]) for i in range(len(self.sizes))]
        total = sum(Fraction(w) for w in self.weights)
        self.quotas = [batch_size * Fraction(w) / total for w in self.weights]
        self.base = [math.floor(q) for q in self.quotas]
        self.extra = batch_size - sum(self.base)
        self.epoch = 0
        self.step = 0  # next step of the stream
        self.drawn = [0] * len(self.sizes)  # prompts taken from each source before `step`
        self._history: deque[tuple[int, list[int]]] = deque(maxlen=64)
        self._consumed: int | None = None
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    # ------------------------------------------------------------------------------------------ schedule
    def counts_at(self, step: int, drawn: Sequence[int]) -> list[int]:
        """Prompts per source at ``step``, given the totals ``drawn`` before it (exact largest-credit rule)."""
        credit = [(step + 1) * q - d - b for q, d, b in zip(self.quotas, drawn, self.base)]
        order = sorted(range(len(credit)), key=lambda i: (-credit[i], i))[: self.extra]
        return [b + (i in order) for i, b in enumerate(self.base)]

    def permutation(self, source: int, epoch: int) -> np.ndarray:
        key = (source, epoch)
        if key not in self._perms:
            for old in [k for k in self._perms if k[0] == source and k[1] < epoch - 1]:
                del self._perms[old]
            rng = np.random.default_rng(_seed(self.seed, 1, source, epoch))
            self._perms[key] = rng.permutation(self.sizes[source])
        return self._perms[key]

    def take(self, source: int, start: int, count: int) -> list[int]:
        """Global indices of the ``count`` prompts of ``source`` after its first ``start`` draws (epoch-aware)."""
        size, out = self.sizes[source], []
        for pos in range(start, start + count):
            out.append(self.offsets[source] + int(self.permutation(source, pos // size)[pos % size]))
        return out

    def next_batch(self) -> list[int]:
        """The batch at the current stream step; advances the stream."""
        counts = self.counts_at(self.step, self.drawn)
        self._history.append((self.step, list(self.drawn)))
        batch = [i for s, c in enumerate(counts) for i in self.take(s, self.drawn[s], c)]
        order = np.random.default_rng(_seed(self.seed, 2, self.step)).permutation(len(batch))
        self.drawn = [d + c for d, c in zip(self.drawn, counts)]
        self.step += 1
        return [batch[i] for i in order]

    def source_of(self, index: int) -> int:
        """Which source a global index belongs to."""
        return max(i for i, off in enumerate(self.offsets) if off <= index)

    def source_epochs(self) -> dict[str, float]:
        """Passes made over each source so far (fractional)."""
        return {name: d / size for name, d, size in zip(self.names, self.drawn, self.sizes)}

    # ------------------------------------------------------------------------------------ Sampler protocol
    def __len__(self) -> int:
        return max(sum(self.sizes) // self.batch_size, 1)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(len(self)):
            yield self.next_batch()

    # --------------------------------------------------------------------------------------------- state
    def mark_consumed(self) -> None:
        """Note that one more yielded batch was trained on (the data loader fetches ahead of training)."""
        self._consumed = min((self._consumed or 0) + 1, self.step)

    def state_dict(self) -> dict[str, Any]:
        """The stream position after the batches consumed so far (or yielded, if nobody marks consumption)."""
        step = self.step if self._consumed is None else self._consumed
        drawn = self.drawn
        if step != self.step:
            drawn = next((d for s, d in self._history if s == step), None)
            if drawn is None:  # further back than the history: replay the counts from the start
                drawn = [0] * len(self.sizes)
                for s in range(step):
                    drawn = [d + c for d, c in zip(drawn, self.counts_at(s, drawn))]
        return {"step": step, "drawn": list(drawn), "epoch": self.epoch, "seed": self.seed, "sizes": list(self.sizes),
                "weights": list(self.weights), "batch_size": self.batch_size, "names": list(self.names)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the sources must have the same sizes as when it was saved."""
        if list(state["sizes"]) != self.sizes:
            raise ValueError(
                f"the checkpoint's data mix had sources {state.get('names')} of sizes {state['sizes']}, this run has "
                f"{self.names} of sizes {self.sizes}; resume with the same data"
            )
        self.step = int(state["step"])
        self.drawn = [int(d) for d in state["drawn"]]
        self.epoch = int(state.get("epoch", 0))
        self.seed = int(state["seed"])
        self._consumed = self.step  # trained on up to here; mark_consumed counts on from it
        self._history.clear()
        self._perms.clear()
