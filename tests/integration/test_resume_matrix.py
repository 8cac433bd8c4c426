"""Exact continuation from every kind of checkpoint, each against an uninterrupted run of the same config.

Each case runs ``steps`` rollout steps straight, then the same config as a chain of runs that finish at each
``stops`` step (``trainer.max_steps``) and continue with ``--ckpt_path last`` to ``steps``; every per-step metric,
every eval metric, every trajectory and the final weights must be equal
(``tests.helpers.resume_helpers.assert_same_run``).
The data has 8 prompts and 4 per step, so an epoch is 2 rollout steps. In-process runs; the real ``kill -9`` of a
real ``rlflow fit`` is ``test_resume.py``'s.
"""

from __future__ import annotations

import logging

import pytest
import torch

from rlflow.cli import cli_main
from tests.helpers.resume_helpers import (
    assert_same_final_state,
    assert_same_run,
    last_checkpoint,
    metrics_by_step,
    run_args,
)

pytestmark = pytest.mark.slow

EVAL = ["--evaluate_every_n_steps=2", "--data.eval_data_path={data}/val.jsonl", "--data.eval.batch_size=4"]
SOURCES = '--data.train_data_path=[{"path": "{data}/a.jsonl", "weight": 3}, {"path": "{data}/b.jsonl", "weight": 1}]'
BINARY_REWARD = ('--data.judging.judgers={"openai/gsm8k": {"class_path": "tests.helpers.resume_helpers.DigitJudger", '
                 '"init_args": {"binary": true}}}')
SOLVED_REWARD = (
    '--data.judging.judgers={"openai/gsm8k": {"class_path": "tests.helpers.resume_helpers.AdditionSolvedJudger"}}'
)
CASES = {  # id: (extra arguments, the steps the chain stops at, steps in all)
    # (a) + (c): a finished run extended, twice: its last.ckpt comes from the end-of-run save (every_n_train_steps
    # never fires), first mid-epoch, then right after the last batch of epoch 0
    "finished-run-extended": (["--checkpoint.every_n_train_steps=5"], (1, 2), 3),
    # (d) several optimizer steps per rollout step: max_steps, the checkpoint and the logged steps count rollout steps
    "optimizer-steps-4": (["--model.update.optimizer_steps=4"], (1,), 3),
    # (e) dynamic sampling's extra draws are seeded with the rollout step (not the optimizer step: 2 per rollout)
    "dynamic-sampling": (
        [
            "--data.filtering.dynamic_sampling=true",
            "--data.filtering.max_rounds=2",
            "--model.update.optimizer_steps=2",
            BINARY_REWARD,
        ],
        (1,),
        3,
    ),
    # (f) evaluation at the step of the checkpoint (run before the next step) and after the resume; stopping at an
    # eval step shows that evaluating does not move the training RNG (else step 3 would differ)
    "eval-between-steps": (EVAL, (2,), 4),
    # (g) two weighted sources (3:1, so the small one is repeated every step): MixBatchSampler's position
    "weighted-sources": ([SOURCES], (1,), 3),
    # (h) a seeded engine: its draws (a count of sampling calls, rlflow.rollout.draws) continue from the checkpoint,
    # and evaluating does not move them
    "seeded-engine": (['--data.rollout={"class_path": "engine", "init_args": {"seed": 5}}', *EVAL], (1,), 3),
    # (i) a KL reference moved toward the policy after steps 2 and 4 (rlflow.training.reference): the checkpoint at
    # step 3
    # holds the moved one (the loaded weights would give step 3 another KL)
    "reference-sync": (
        ["--model.loss.kl_coef=0.05", "--model.reference.sync_steps=2", "--model.reference.mixup_alpha=0.5"],
        (3,),
        4,
    ),
    # (j) solved prompts left out of later epochs: the solved set and each epoch's left-out set are checkpointed
    # (stopping at 3: inside the second shortened epoch)
    "skip-solved": (["--data.filtering.skip_solved=true", SOLVED_REWARD], (3,), 5),
    # (k) the same pipelined, stopped at the end of epoch 0: the generator's look-ahead fixed epoch 1's set then, and
    # its job in flight is the first batch of the shortened epoch 1
    "skip-solved-pipelined": (
        ["--data.filtering.skip_solved=true", SOLVED_REWARD, "--data.pipeline.max_staleness=1"],
        (2,),
        5,
    ),
}


@pytest.fixture(scope="module")
def mix_data(small_data):
    """Two sources cut from the 8 prompts: a.jsonl (6) and b.jsonl (2)."""
    rows = (small_data / "train.jsonl").read_text().splitlines()
    (small_data / "a.jsonl").write_text("\n".join(rows[:6]) + "\n")
    (small_data / "b.jsonl").write_text("\n".join(rows[6:]) + "\n")
    return small_data


@pytest.mark.parametrize("case", list(CASES))
def test_continuing_from_a_checkpoint_matches_the_straight_run(case, tiny_model, mix_data, tmp_path, one_thread):
    extra, stops, steps = CASES[case]
    extra = [arg.replace("{data}", str(mix_data)) for arg in extra]
    straight, chained = tmp_path / "straight", tmp_path / "chained"
    cli_main(run_args(tiny_model, mix_data, straight, *extra, steps=steps))
    for i, stop in enumerate((*stops, steps)):
        resume = ["--ckpt_path=last"] if i else []
        cli = cli_main(run_args(tiny_model, mix_data, chained, *extra, *resume, steps=stop))
        assert cli.trainer.global_step == stop  # rollout steps, whatever optimizer_steps is
    assert_same_run(straight, chained, steps)
    assert_same_final_state(straight, chained, steps)
    if case == "dynamic-sampling":  # extra prompts were really drawn
        assert [row["sampling/rounds"] for row in metrics_by_step(straight).values()].count(2.0) >= 2


def test_a_finished_run_extended_follows_the_longer_lr_schedule(tiny_model, small_data, tmp_path, one_thread):
    """A decaying schedule spans the run's ``max_steps``; continuing with a larger one stretches it to the new end
    from the optimizer step reached, as a straight run of the new length has it (it stayed at the old end, lr 0)."""
    extra = ["--model.optim.lr_schedule=linear", "--model.update.optimizer_steps=2"]
    straight, chained = tmp_path / "straight", tmp_path / "chained"
    cli_main(run_args(tiny_model, small_data, straight, *extra, steps=4))
    cli_main(run_args(tiny_model, small_data, chained, *extra, steps=2))
    cli_main(run_args(tiny_model, small_data, chained, *extra, "--ckpt_path=last", steps=4))
    a, b = metrics_by_step(straight), metrics_by_step(chained)
    assert b[1]["lr"] == 0.0  # the 2-step run's schedule ended with it
    assert [b[s]["lr"] for s in (2, 3)] == [a[s]["lr"] for s in (2, 3)] == [pytest.approx(2.5e-4), 0.0]  # 2 of 8 left
    final_a = torch.load(last_checkpoint(straight), weights_only=True)["lr_schedulers"]
    assert torch.load(last_checkpoint(chained), weights_only=True)["lr_schedulers"] == final_a


def test_continuing_a_finished_run_says_it_is_finished_and_trains_nothing(
    tiny_model, small_data, tmp_path, one_thread, caplog
):
    cli_main(run_args(tiny_model, small_data, tmp_path, steps=2))
    before = torch.load(last_checkpoint(tmp_path), weights_only=False)["global_step"]
    with caplog.at_level(logging.INFO, logger="rlflow"):
        cli = cli_main(run_args(tiny_model, small_data, tmp_path, "--ckpt_path=last", steps=2))
    assert before == 2 and cli.trainer.global_step == 2
    assert (
        "the checkpoint is at rollout step 2 and trainer.max_steps=2: the run is already finished, nothing is "
        "trained (raise --trainer.max_steps to continue it)"
    ) in caplog.text
