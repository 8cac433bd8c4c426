"""``data.filtering.skip_solved`` in ``rlflow fit``: on policy and pipelined, no prompt solved before an epoch's set
was fixed
is trained in that epoch, and the run's epochs shrink accordingly; a weighted mix is refused; with dynamic sampling
the groups it drops are still marked."""

from __future__ import annotations

import json
import re

import pytest

from rlflow.cli import cli_main
from tests.helpers.resume_helpers import metrics_by_step, run_args


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
    args = run_args(
        tiny_model,
        small_data,
        tmp_path,
        "--data.filtering.skip_solved=true",
        f"--data.pipeline.max_staleness={staleness}",
        (
            '--data.judging.judgers={"openai/gsm8k": '
            '{"class_path": "tests.helpers.resume_helpers.AdditionSolvedJudger"}}'
        ),
        steps=5,
    )
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
    mix = (
        f'--data.train_data_path=[{{"path": "{tmp_path / "a.jsonl"}", "weight": 3}}, '
        f'{{"path": "{tmp_path / "b.jsonl"}", "weight": 1}}]'
    )
    with pytest.raises(Exception, match="data.filtering.skip_solved works with one training source"):
        cli_main(run_args(tiny_model, small_data, tmp_path, "--data.filtering.skip_solved=true", mix, steps=1))


def test_with_dynamic_sampling_the_solved_groups_it_drops_are_still_marked(
    tiny_model, small_data, tmp_path, one_thread
):
    """Dynamic sampling drops the solved groups (equal rewards) before training; the step's own prompts are marked
    from their first judging, so later epochs still leave every addition out."""
    solved = additions(small_data)
    args = run_args(
        tiny_model,
        small_data,
        tmp_path,
        "--data.filtering.skip_solved=true",
        "--data.filtering.dynamic_sampling=true",
        (
            '--data.judging.judgers={"openai/gsm8k": '
            '{"class_path": "tests.helpers.resume_helpers.AdditionSolvedJudger"}}'
        ),
        steps=3,
    )
    cli = cli_main(args)
    assert cli.model.last_metrics["data/solved_prompts"] == len(solved)
    assert cli.model.last_metrics["data/skipped_prompts"] == len(solved)
    assert sum(row["sampling/groups_dropped"] for row in metrics_by_step(tmp_path).values()) > 0  # it dropped some
