"""A seeded, epoch-aware sampler of prompt batches.

Each epoch is a fresh permutation of the prompts drawn from ``seed + epoch``, cut into batches of
``batch_size`` (the incomplete last batch is dropped, so every rollout step has the same group count). The
same seed gives the same order on every rank. Its position (the epoch and the batches of it already trained
on) is checkpointed through :class:`PromptLoader`, a ``DataLoader`` that Lightning saves and restores itself, so a
run resumed mid-epoch continues with the batch it would have drawn next.

With ``skip_solved`` (``data.filtering.skip_solved``), an epoch's permutation leaves out the prompts whose last group
was
solved (every completion correct, :meth:`PromptBatchSampler.record`), as Skywork-OR1 and POLARIS filter prompts
by pass rate: they give zero advantages and cost a rollout. The set left out of an epoch is fixed the first time
that epoch's order is asked for (the pipelined generator's look-ahead may ask first) and checkpointed, so a
resumed run draws the same batches. Simplification: a prompt stays out until the run ends (nothing re-checks it);
when fewer than a batch of prompts would be left, the epoch takes them all.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from rlflow.config_error import ConfigError


class PromptBatchSampler(Sampler[list[int]]):
    """Yields lists of prompt indices, one list per rollout step."""

    def __init__(self, num_prompts: int, batch_size: int, seed: int = 0, shuffle: bool = True,
                 skip_solved: bool = False) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_prompts < batch_size:
            raise ConfigError(f"the dataset has {num_prompts} usable prompts, fewer than data.global_batch_size="
                              f"{batch_size} (one rollout step's prompts); lower it or add rows")
        self.num_prompts = num_prompts
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.start_batch = 0  # batches of the current epoch already consumed (set on resume)
        self.consumed = 0  # batches of the current epoch handed to training (Lightning prefetches one more)
        self.skip_solved = skip_solved
        self.solved: set[int] = set()  # prompts whose last group was solved
        self.excluded: dict[int, list[int]] = {}  # epoch -> prompts left out of it, fixed when first asked

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

    def record(self, index: int, solved: bool) -> None:
        """Whether prompt ``index``'s latest group was solved (``skip_solved``: later epochs leave it out)."""
        if solved:
            self.solved.add(index)
        else:
            self.solved.discard(index)

    def left_out(self, epoch: int) -> list[int]:
        """The prompts epoch ``epoch`` leaves out: the solved ones when it was first asked for (kept from then on,
        older epochs forgotten), none where that would leave less than a batch."""
        if not self.skip_solved or epoch == 0:
            return []
        if epoch not in self.excluded:
            solved = sorted(self.solved)
            self.excluded = {e: v for e, v in self.excluded.items() if e >= epoch - 1}
            self.excluded[epoch] = solved if self.num_prompts - len(solved) >= self.batch_size else []
        return self.excluded[epoch]

    def order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            order = list(range(self.num_prompts))
        else:
            g = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_prompts, generator=g).tolist()
        skip = set(self.left_out(epoch))
        return [i for i in order if i not in skip] if skip else order

    def __len__(self) -> int:
        return (self.num_prompts - len(self.left_out(self.epoch))) // self.batch_size

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order(self.epoch)
        start, self.start_batch = self.start_batch, 0
        for b in range(start, len(order) // self.batch_size):
            yield order[b * self.batch_size: (b + 1) * self.batch_size]

    def state_dict(self) -> dict[str, Any]:
        state = {"epoch": self.epoch, "seed": self.seed, "consumed": self.consumed, "num_prompts": self.num_prompts}
        if self.skip_solved:
            state["solved"] = sorted(self.solved)
            state["excluded"] = {int(e): list(v) for e, v in self.excluded.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("num_prompts", self.num_prompts) != self.num_prompts:
            raise ValueError(
                f"the checkpoint's prompt sampler covered {state['num_prompts']} prompts but the dataset now has "
                f"{self.num_prompts}: resume with the same data.train_data_path and data.max_prompt_length"
            )
        self.epoch = int(state["epoch"])
        self.seed = int(state["seed"])
        self.consumed = self.start_batch = int(state.get("consumed", 0))
        self.solved = set(state.get("solved", []))
        self.excluded = {int(e): list(v) for e, v in state.get("excluded", {}).items()}


class PromptLoader(DataLoader):
    """A ``DataLoader`` over a :class:`PromptBatchSampler` whose ``state_dict`` is the sampler's position.

    Lightning saves the state of a loader that has ``state_dict``/``load_state_dict`` in every checkpoint and
    restores it before it iterates again, which is what makes a mid-epoch resume exact.
    """

    def state_dict(self) -> dict[str, Any]:
        return self.batch_sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.batch_sampler.load_state_dict(state)
