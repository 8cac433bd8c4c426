"""A seeded, epoch-aware sampler of prompt batches.

Each epoch is a fresh permutation of the prompts drawn from ``seed + epoch``, cut into batches of
``batch_size`` (the incomplete last batch is dropped, so every rollout step has the same group count). The
same seed gives the same order on every rank. Its position (the epoch and the batches of it already trained
on) is checkpointed through :class:`PromptLoader`, a ``DataLoader`` that Lightning saves and restores itself, so a
run resumed mid-epoch continues with the batch it would have drawn next.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler


class PromptBatchSampler(Sampler[list[int]]):
    """Yields lists of prompt indices, one list per rollout step."""

    def __init__(self, num_prompts: int, batch_size: int, seed: int = 0, shuffle: bool = True) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_prompts < batch_size:
            raise ValueError(
                f"the dataset has {num_prompts} usable prompts, fewer than data.global_batch_size={batch_size}"
            )
        self.num_prompts = num_prompts
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.start_batch = 0  # batches of the current epoch already consumed (set on resume)
        self.consumed = 0  # batches of the current epoch handed to training (Lightning prefetches one more)

    @property
    def sampler(self) -> PromptBatchSampler:
        """Lightning calls ``batch_sampler.sampler.set_epoch(epoch)`` each epoch; pointing here makes it reach us."""
        return self

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.start_batch = 0
            self.consumed = 0
        self.epoch = epoch

    def mark_consumed(self) -> None:
        """Record that one more batch of this epoch was trained on (called by the datamodule per rollout step)."""
        self.consumed += 1

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_prompts))
        g = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_prompts, generator=g).tolist()

    def __len__(self) -> int:
        return self.num_prompts // self.batch_size

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order(self.epoch)
        start, self.start_batch = self.start_batch, 0
        for b in range(start, len(self)):
            yield order[b * self.batch_size: (b + 1) * self.batch_size]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "seed": self.seed, "consumed": self.consumed, "num_prompts": self.num_prompts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_prompts", self.num_prompts) != self.num_prompts:
            raise ValueError(
                f"the checkpoint's prompt sampler covered {state['num_prompts']} prompts but the dataset now has "
                f"{self.num_prompts}: resume with the same data.train_data_path and data.max_prompt_length"
            )
        self.epoch = int(state["epoch"])
        self.seed = int(state["seed"])
        self.consumed = self.start_batch = int(state.get("consumed", 0))


class PromptLoader(DataLoader):
    """A ``DataLoader`` over a :class:`PromptBatchSampler` whose ``state_dict`` is the sampler's position.

    Lightning saves the state of a loader that has ``state_dict``/``load_state_dict`` in every checkpoint and
    restores it before it iterates again, which is what makes a mid-epoch resume exact.
    """

    def state_dict(self) -> dict[str, Any]:
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch_sampler.load_state_dict(state)
