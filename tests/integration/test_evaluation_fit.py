"""Evaluation through ``rlflow fit`` and ``rlflow validate``: accuracy per data source, ``evaluate_every_n_steps``
with k samples, maj@k, and the eval trajectories."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from rlflow.cli import cli_main
from rlflow.judgers.base import Judger
from tests.helpers.fit import fit_args
from tests.unit.training.test_evaluation import write_eval_file


class AdditionJudger(Judger):
    """Reward 1 for the prompts that are additions, whatever the completion: accuracy is known from the data alone."""

    name = "addition"

    def __init__(self, bonus: float = 0.0) -> None:
        self.bonus = bonus

    def score(self, completion: str, extra_info=None, **sample) -> float:
        return 1.0 if "+" in extra_info["question"] else 0.0


def test_validate_reports_accuracy_per_data_source(tiny_model, tiny_data, tmp_path):
    expected = write_eval_file(tiny_data, tmp_path / "eval.jsonl")
    args = fit_args(
        tiny_model,
        tiny_data,
        tmp_path,
        f"--data.eval_data_path={tmp_path / 'eval.jsonl'}",
        '--data.judging.judgers={"*": {"class_path": "tests.integration.test_evaluation_fit.AdditionJudger"}}',
        "--data.eval.batch_size=4",
    )
    args[0] = "validate"
    args = [a for a in args if not a.startswith("--trainer.max_steps")]
    metrics = {k: float(v) for k, v in cli_main(args).trainer.callback_metrics.items()}
    assert metrics["eval/accuracy"] == pytest.approx(expected["all"])
    assert metrics["eval/openai/gsm8k/accuracy"] == pytest.approx(expected["openai/gsm8k"])
    assert metrics["eval/other/set/accuracy"] == pytest.approx(expected["other/set"])
    assert 0 < expected["all"] < 1  # the data mixes both answers, so a wrong grouping would show
    assert "eval/pass@1" not in metrics  # greedy, one sample: accuracy only
    assert metrics["eval/judger_failures"] == 0  # logged with the rest; this judger never fails


def test_evaluate_every_n_steps_with_k_samples(tiny_model, tiny_data, tmp_path):
    write_eval_file(tiny_data, tmp_path / "eval.jsonl")
    args = fit_args(
        tiny_model,
        tiny_data,
        tmp_path,
        f"--data.eval_data_path={tmp_path / 'eval.jsonl'}",
        '--data.judging.judgers={"*": {"class_path": "tests.unit.training.test_evaluation.DigitJudger"}}',
        "--data.eval.k=3",
        "--data.eval.temperature=1.0",
        "--evaluate_every_n_steps=2",
        "--model.export_hf=false",
        steps=4,
    )
    cli = cli_main(args)
    with open(Path(cli.trainer.log_dir) / "metrics.csv") as f:
        evals = [row for row in csv.DictReader(f) if row.get("eval/accuracy")]
    assert [int(r["step"]) for r in evals] == [1, 3]  # after rollout steps 2 and 4 (Lightning logs step - 1)
    for row in evals:
        acc, pass3 = float(row["eval/accuracy"]), float(row["eval/pass@3"])
        assert 0.0 <= acc <= pass3 <= 1.0
        assert "eval/other/set/pass@3" in row and row["eval/other/set/pass@3"] != ""


def test_evaluate_every_n_steps_maps_to_lightning(tiny_model, tiny_data, tmp_path):
    args = fit_args(
        tiny_model,
        tiny_data,
        tmp_path,
        f"--data.eval_data_path={tiny_data / 'val.jsonl'}",
        "--evaluate_every_n_steps=5",
    )
    trainer = cli_main(args[1:], run=False).trainer  # [1:]: no subcommand
    assert trainer.val_check_interval == 5 and trainer.check_val_every_n_epoch is None
    with pytest.raises(ValueError, match="needs an eval set: .* or --evaluate_every_n_steps null to train without"):
        cli_main(fit_args(tiny_model, tiny_data, tmp_path, "--evaluate_every_n_steps=5")[1:], run=False)
    # what the message says turns evaluation off where a config file sets it
    config = tmp_path / "evaluating.yaml"
    config.write_text(f"evaluate_every_n_steps: 5\ndata:\n  eval_data_path: {tiny_data / 'val.jsonl'}\n")
    off = [*fit_args(tiny_model, tiny_data, tmp_path)[1:], f"--config={config}", "--data.eval_data_path=null"]
    with pytest.raises(ValueError, match="evaluate_every_n_steps=5 needs an eval set"):
        cli_main(off, run=False)
    trainer = cli_main([*off, "--evaluate_every_n_steps=null"], run=False).trainer
    assert trainer.val_check_interval == 1.0 and trainer.check_val_every_n_epoch == 1  # Lightning's defaults


EVAL_SEEN: list[tuple[str, str]] = []


def first_char_class(text: str) -> str | None:
    """What the test's judger states as a completion's answer: the class of its first character."""
    if not text:
        return None
    return "digit" if text[0].isdigit() else "letter" if text[0].isalpha() else "other"


class FirstCharJudger(Judger):
    """Reward 1 when the completion starts with a digit; states the class of its first character as its answer. It
    records what it scored, so the test can vote on its own."""

    name = "first_char"

    def score(self, completion: str, extra_info=None, **sample) -> float:
        EVAL_SEEN.append((extra_info["question"], completion))
        return float(first_char_class(completion) == "digit")

    def answer(self, completion: str) -> str | None:
        return first_char_class(completion)


def test_validate_reports_maj_at_k_as_a_plain_vote_over_the_judged_samples(tiny_model, tiny_data, tmp_path):
    """``rlflow validate`` with 5 samples per prompt: ``eval/maj@5`` equals a majority vote recomputed here from the
    completions the judger saw (a plain count, ties to the class seen first)."""
    write_eval_file(tiny_data, tmp_path / "eval.jsonl")
    args = fit_args(
        tiny_model,
        tiny_data,
        tmp_path,
        f"--data.eval_data_path={tmp_path / 'eval.jsonl'}",
        '--data.judging.judgers={"*": {"class_path": "tests.integration.test_evaluation_fit.FirstCharJudger"}}',
        "--data.judging.isolation=thread",  # the judger fills EVAL_SEEN in this process
        "--data.eval.k=5",
        "--data.eval.temperature=1.0",
        "--data.eval.batch_size=4",
    )
    args[0] = "validate"
    args = [a for a in args if not a.startswith("--trainer.max_steps")]
    EVAL_SEEN.clear()
    cli = cli_main(args)
    metrics = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    rows = [json.loads(line) for line in (Path(cli.trainer.log_dir) / "eval_trajectories.jsonl").open()]
    assert len(rows) == 30 and all(r.get("answer") == first_char_class(r["completion"]) for r in rows)
    by_prompt: dict[str, list[str]] = {}
    for question, text in EVAL_SEEN:
        by_prompt.setdefault(question, []).append(text)
    assert len(by_prompt) == 6 and all(len(texts) == 5 for texts in by_prompt.values())
    votes = []
    for texts in by_prompt.values():
        classes = [first_char_class(t) for t in texts]
        best, best_count = None, 0
        for c in classes:
            if c is not None and classes.count(c) > best_count:
                best, best_count = c, classes.count(c)
        votes.append(best == "digit")
    assert metrics["eval/maj@5"] == pytest.approx(sum(votes) / len(votes))
    accuracy = sum(first_char_class(t) == "digit" for _, t in EVAL_SEEN) / len(EVAL_SEEN)
    assert metrics["eval/accuracy"] == pytest.approx(accuracy)
    assert 0 < accuracy < 1  # the samples disagree, so the vote is not the accuracy by construction


def test_eval_trajectories_hold_every_eval_sample_and_agree_with_the_metrics(tiny_model, tiny_data, tmp_path):
    """``eval_trajectories.jsonl`` gets one row per eval sample at each evaluation; per evaluation its rewards and
    correct flags average to the logged ``eval/reward`` and ``eval/accuracy``, and each row's reward is the judger's
    on the row's own completion (recomputed here)."""
    write_eval_file(tiny_data, tmp_path / "eval.jsonl")
    args = fit_args(
        tiny_model,
        tiny_data,
        tmp_path,
        f"--data.eval_data_path={tmp_path / 'eval.jsonl'}",
        '--data.judging.judgers={"*": {"class_path": "tests.unit.training.test_evaluation.DigitJudger"}}',
        "--data.eval.k=2",
        "--data.eval.temperature=1.0",
        "--evaluate_every_n_steps=2",
        "--model.export_hf=false",
        steps=4,
    )
    cli = cli_main(args)
    log_dir = Path(cli.trainer.log_dir)
    rows = [json.loads(line) for line in (log_dir / "eval_trajectories.jsonl").read_text().splitlines()]
    with open(log_dir / "metrics.csv") as f:
        evals = [row for row in csv.DictReader(f) if row.get("eval/accuracy")]
    assert sorted({r["trained_steps"] for r in rows}) == [2, 4] and len(rows) == 2 * 6 * 2
    for trained, logged in zip([2, 4], evals):
        mine = [r for r in rows if r["trained_steps"] == trained]
        assert sorted((r["prompt"], r["sample"]) for r in mine) == sorted(
            (p, s) for p in {r["prompt"] for r in mine} for s in range(2)
        )  # every prompt, both samples
        assert float(logged["eval/reward"]) == pytest.approx(sum(r["reward"] for r in mine) / len(mine))
        assert float(logged["eval/accuracy"]) == pytest.approx(sum(r["correct"] for r in mine) / len(mine))
    assert all(r["reward"] == float(any(ch.isdigit() for ch in r["completion"])) for r in rows)
    assert 0 < sum(r["reward"] for r in rows) < len(rows)  # both kinds of sample, so a mix-up would show


def test_validate_from_a_checkpoint_scores_the_weights_as_the_fit_did(tiny_model, tiny_data, tmp_path):
    """Sampled evaluation is seeded by the rollout steps trained: ``rlflow validate --ckpt_path`` loads only the
    weights, and counted from 0 (another sample, another score, ``trained_steps`` 0 in the rows)."""
    eval_args = [f"--data.eval_data_path={tiny_data / 'val.jsonl'}", "--data.eval.temperature=1.0",
                 "--data.eval.k=2", "--data.eval.batch_size=8"]
    fitted = cli_main(fit_args(tiny_model, tiny_data, tmp_path, "--evaluate_every_n_steps=2", "--model.export_hf=false",
                               *eval_args, steps=2))
    in_fit = float(fitted.trainer.callback_metrics["eval/accuracy"])
    log_dir = Path(fitted.trainer.log_dir)
    args = [a for a in fit_args(tiny_model, tiny_data, tmp_path / "validate", *eval_args)
            if not a.startswith("--trainer.max_steps")]
    validated = cli_main(["validate", *args[1:], f"--ckpt_path={log_dir / 'checkpoints' / 'last.ckpt'}"])
    assert float(validated.trainer.callback_metrics["eval/accuracy"]) == in_fit
    assert validated.model.trained_steps == 2
