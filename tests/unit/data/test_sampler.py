"""The seeded prompt sampler (:mod:`rlflow.data.sampler`) with ``skip_solved``.

What is checked: by hand, an epoch's order is the seeded permutation without the prompts solved when the epoch was
first asked for (fixed from then on, checkpointed, not applied to epoch 0, dropped when less than a batch would be
left); the pipelined look-ahead fixes the next epoch's set in the sampler it peeks at. Through ``rlflow fit``:
``tests/integration/test_sampler_fit.py``; exact resume: ``test_resume_matrix.py``'s ``skip-solved`` case.
"""


from __future__ import annotations

import torch

from rlflow.data.sampler import PromptBatchSampler
from rlflow.rollout.pipeline import peek_next_batch


def permutation(n: int, seed: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def batches(sampler: PromptBatchSampler, epoch: int) -> list[list[int]]:
    sampler.set_epoch(epoch)
    return [list(b) for b in sampler]


def test_an_epoch_leaves_out_the_prompts_solved_when_it_was_first_asked_for():
    sampler = PromptBatchSampler(10, 3, seed=4, skip_solved=True)
    for i in (2, 5, 7):
        sampler.record(i, True)
    sampler.record(3, False)
    assert batches(sampler, 0) == [permutation(10, 4)[b * 3:(b + 1) * 3] for b in range(3)]  # epoch 0: all
    kept = [i for i in permutation(10, 5) if i not in (2, 5, 7)]
    assert batches(sampler, 1) == [kept[:3], kept[3:6]] and len(sampler) == 2  # 7 left: 2 batches of 3
    sampler.record(8, True)  # solved during epoch 1: epoch 1's set is fixed already
    assert batches(sampler, 1) == [kept[:3], kept[3:6]]
    sampler.record(5, False)  # a solved prompt sampled again (elsewhere) and missed: back in
    kept = [i for i in permutation(10, 6) if i not in (2, 7, 8)]
    assert batches(sampler, 2) == [kept[:3], kept[3:6]]


def test_the_left_out_sets_survive_a_checkpoint_and_too_few_prompts_leave_none_out():
    sampler = PromptBatchSampler(10, 3, seed=4, skip_solved=True)
    for i in (2, 5, 7):
        sampler.record(i, True)
    first = batches(sampler, 1)
    sampler.record(9, True)
    restored = PromptBatchSampler(10, 3, seed=4, skip_solved=True)
    restored.load_state_dict(sampler.state_dict())
    assert [list(b) for b in restored] == first  # epoch 1 keeps the set it was fixed with, not {2, 5, 7, 9}
    assert batches(restored, 2) == batches(sampler, 2)
    small = PromptBatchSampler(4, 3, seed=0, skip_solved=True)
    small.record(0, True)
    small.record(1, True)  # 2 left < a batch of 3: nothing left out
    assert batches(small, 1) == [permutation(4, 1)[:3]]
    off = PromptBatchSampler(10, 3, seed=4)
    off.record(2, True)
    assert batches(off, 1) == [permutation(10, 5)[b * 3:(b + 1) * 3] for b in range(3)]  # skip_solved off


def test_the_pipelined_look_ahead_fixes_the_next_epochs_set_in_the_sampler():
    sampler = PromptBatchSampler(8, 4, seed=0, skip_solved=True)
    sampler.set_epoch(0)
    iter(sampler)
    sampler.consumed = 2  # the end of epoch 0
    sampler.record(1, True)
    ahead = peek_next_batch(sampler)  # the first batch of epoch 1, computed on a copy
    sampler.record(6, True)  # judged after the look-ahead: epoch 1 keeps the set the look-ahead saw
    assert sampler.excluded[1] == [1]
    assert batches(sampler, 1)[0] == ahead == [i for i in permutation(8, 1) if i != 1][:4]

