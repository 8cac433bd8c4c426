"""The seeded prompt sampler (:mod:`rlflow.data.sampler`) with ``skip_solved``, and the solved prompts in a run.

What is checked: by hand, an epoch's order is the seeded permutation without the prompts solved when the epoch was
first asked for (fixed from then on, checkpointed, not applied to epoch 0, dropped when less than a batch would be
left); the pipelined look-ahead fixes the next epoch's set in the sampler it peeks at; through ``rlflow fit``, on
policy and pipelined, no prompt solved before an epoch's set was fixed is trained in that epoch, and the run's
epochs shrink accordingly. (Exact resume: ``test_resume_matrix.py``'s ``skip-solved`` case.)
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from resume_helpers import metrics_by_step, run_args

from rlflow.cli import cli_main
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


def additions(data) -> set[str]:
    questions = [json.loads(line)["extra_info"]["question"] for line in (data / "train.jsonl").open()]
    return {q for q in questions if "+" in q}


def trained_prompts(root) -> dict[int, set[str]]:
    """The questions trained at each rollout step, from trajectories.jsonl."""
    out: dict[int, set[str]] = {}
    for path in root.glob("lightning_logs/version_*/trajectories.jsonl"):
        for line in path.open():
            row = json.loads(line)
            out.setdefault(row["step"], set()).add(re.search(r"What is [^?]*\?", row["prompt"]).group(0))
    return out


@pytest.mark.parametrize("staleness", [0, 1])
def test_solved_prompts_are_not_trained_in_later_epochs(tiny_model, small_data, tmp_path, one_thread, staleness):
    """8 prompts, 4 per step; every addition's group is solved. On policy, an epoch's set is fixed when the previous
    one has been judged, so no addition is trained after epoch 0. Pipelined, the look-ahead fixes it while the last
    step of the previous epoch is still being judged, so epoch 1 leaves out the additions of step 0 and epoch 2 all."""
    solved = additions(small_data)
    assert 1 <= len(solved) <= 4  # leaves at least a batch to train on, so epochs shrink
    args = run_args(tiny_model, small_data, tmp_path, "--data.skip_solved=true", f"--data.max_staleness={staleness}",
                    '--data.judgers={"openai/gsm8k": {"class_path": "resume_helpers.AdditionSolvedJudger"}}',
                    steps=5)
    cli = cli_main(args)
    assert cli.trainer.global_step == 5
    trained = trained_prompts(tmp_path)
    questions = {q for qs in trained.values() for q in qs}
    assert trained[0] | trained[1] == questions | solved and len(trained[0] | trained[1]) == 8  # epoch 0: all
    if staleness == 0:
        assert all(not trained[s] & solved for s in (2, 3, 4))
    else:
        assert not trained[2] & (trained[0] & solved)
        assert all(not trained[s] & solved for s in (3, 4))
    assert cli.model.last_metrics["data/solved_prompts"] == len(solved)
    assert cli.model.last_metrics["data/skipped_prompts"] == len(solved)


def test_skip_solved_refuses_a_weighted_mix(tiny_model, small_data, tmp_path):
    rows = (small_data / "train.jsonl").read_text().splitlines()
    (tmp_path / "a.jsonl").write_text("\n".join(rows[:6]) + "\n")
    (tmp_path / "b.jsonl").write_text("\n".join(rows[6:]) + "\n")
    mix = (f'--data.train_data_path=[{{"path": "{tmp_path / "a.jsonl"}", "weight": 3}}, '
           f'{{"path": "{tmp_path / "b.jsonl"}", "weight": 1}}]')
    with pytest.raises(Exception, match="data.skip_solved works with one training source"):
        cli_main(run_args(tiny_model, small_data, tmp_path, "--data.skip_solved=true", mix, steps=1))


def test_with_dynamic_sampling_the_solved_groups_it_drops_are_still_marked(tiny_model, small_data, tmp_path,
                                                                           one_thread):
    """Dynamic sampling drops the solved groups (equal rewards) before training; the step's own prompts are marked
    from their first judging, so later epochs still leave every addition out."""
    solved = additions(small_data)
    args = run_args(tiny_model, small_data, tmp_path, "--data.skip_solved=true", "--data.dynamic_sampling=true",
                    '--data.judgers={"openai/gsm8k": {"class_path": "resume_helpers.AdditionSolvedJudger"}}',
                    steps=3)
    cli = cli_main(args)
    assert cli.model.last_metrics["data/solved_prompts"] == len(solved)
    assert cli.model.last_metrics["data/skipped_prompts"] == len(solved)
    assert sum(row["sampling/groups_dropped"] for row in metrics_by_step(tmp_path).values()) > 0  # it dropped some
