"""``--ckpt_path last`` resumes this config's run: its logger version (or the one named), never another run's
checkpoint in the same logger directory; it says when there is none, lists the settings that changed, applies
the learning rate and schedule, refuses what cannot change, and falls back past a truncated checkpoint.

The data has 8 prompts and 4 per step (an epoch is 2 rollout steps); CSV logs are flushed every step.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import pytest
import torch
import yaml

from rlflow.cli import cli_main, main
from tests.helpers.resume_helpers import MEASURED, assert_same_final_state, assert_same_run, metrics_by_step, run_args

pytestmark = pytest.mark.slow


def version_metrics(version_dir: Path) -> dict[int, dict[str, float]]:
    """The training rows (those with a loss) of one log version's metrics.csv, by step."""
    with open(version_dir / "metrics.csv") as f:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    return {int(row["step"]): row for row in rows if "loss" in row}


def test_last_resumes_this_configs_run_not_a_newer_run_in_the_same_directory(
    tiny_model, small_data, tmp_path, one_thread, caplog
):
    logs = tmp_path / "lightning_logs"
    cli_main(run_args(tiny_model, small_data, tmp_path, steps=2))  # version_0: this run
    # version_1: another run in the same logger directory (another seed, another lr), written later
    cli_main(run_args(tiny_model, small_data, tmp_path, "--data.seed=1", "--model.optim.lr=1e-2", steps=3))
    with caplog.at_level(logging.INFO, logger="rlflow"):
        cli = cli_main(run_args(tiny_model, small_data, tmp_path, "--ckpt_path=last", steps=3))
    assert Path(cli.trainer.ckpt_path) == logs / "version_0" / "checkpoints" / "last.ckpt"
    assert f"resuming {logs / 'version_0' / 'checkpoints' / 'last.ckpt'} at rollout step 2" in caplog.text
    assert cli.trainer.global_step == 3
    assert version_metrics(logs / "version_2")[2]["lr"] == pytest.approx(1e-3)  # this run's lr, not version_1's


def test_a_named_version_resumes_that_version_and_keeps_its_logs(tiny_model, small_data, tmp_path, one_thread):
    logs = tmp_path / "lightning_logs"
    cli_main(run_args(tiny_model, small_data, tmp_path, "--trainer.logger.version=a", steps=2))
    # run b differs only in its learning rate: only the version tells the two apart
    cli_main(run_args(tiny_model, small_data, tmp_path, "--trainer.logger.version=b", "--model.optim.lr=1e-2",
                      steps=3))
    straight = tmp_path / "straight"
    cli_main(run_args(tiny_model, small_data, straight, steps=3))

    cli = cli_main(run_args(tiny_model, small_data, tmp_path, "--trainer.logger.version=a", "--ckpt_path=last",
                            steps=3))
    assert Path(cli.trainer.ckpt_path) == logs / "a" / "checkpoints" / "last.ckpt"
    resumed, reference = version_metrics(logs / "a"), metrics_by_step(straight)
    assert sorted(resumed) == [0, 1, 2]  # the rows written before the resume are kept, none twice
    for step, row in resumed.items():
        for key in row.keys() - MEASURED:
            assert row[key] == reference[step][key], (step, key)


@pytest.mark.parametrize(
    "change",
    [
        ["--model.optim.lr=5e-4"],
        ["--model.optim.lr_schedule=linear"],
        ["--model.optim.warmup_steps=3", "--model.optim.lr_schedule=cosine", "--model.optim.lr=2e-3"],
    ],
    ids=["lr", "schedule", "warmup-cosine-lr"],
)
def test_a_changed_learning_rate_or_schedule_is_what_the_resumed_run_trains_at(
    change, tiny_model, small_data, tmp_path, one_thread, caplog
):
    """The optimizer state in the checkpoint carries the old lr (its param groups, the scheduler's base lrs); the
    resumed run trains at the new one, at the point of the new schedule a straight run of it has reached."""
    run, straight = tmp_path / "run", tmp_path / "straight"
    cli_main(run_args(tiny_model, small_data, straight, *change, steps=4))
    cli_main(run_args(tiny_model, small_data, run, "--trainer.logger.version=v", steps=2))
    with caplog.at_level(logging.INFO, logger="rlflow"):
        cli_main(run_args(tiny_model, small_data, run, "--trainer.logger.version=v", "--ckpt_path=last", *change,
                          steps=4))
    key, new = change[0].removeprefix("--").split("=")
    assert "settings that differ from the checkpoint's run" in caplog.text and key in caplog.text
    lrs, straight_lrs = version_metrics(run / "lightning_logs" / "v"), metrics_by_step(straight)
    for step in (2, 3):
        assert lrs[step]["lr"] == pytest.approx(straight_lrs[step]["lr"], rel=1e-6), step
    last = torch.load(run / "lightning_logs" / "v" / "checkpoints" / "last.ckpt", weights_only=True)
    group = last["optimizer_states"][0]["param_groups"][0]
    assert group["initial_lr"] == group["lr"] or change != ["--model.optim.lr=5e-4"]
    assert group["initial_lr"] == pytest.approx(last["hyper_parameters"]["optim"]["lr"])  # the configured lr
    used = yaml.safe_load((run / "lightning_logs" / "v" / "config.yaml").read_text())["model"]["optim"]
    assert used[key.split(".")[-1]] == type(used[key.split(".")[-1]])(new)  # config.yaml records what was used


@pytest.mark.parametrize(
    "change, shown",
    [("--data.prompt_repeat_k=2", "data.prompt_repeat_k 4 -> 2"), ("--model.loss=grpo", "model.loss bnpo -> grpo")],
)
def test_a_change_that_cannot_continue_the_run_is_refused_in_one_line(
    change, shown, tiny_model, small_data, tmp_path, one_thread, capsys
):
    cli_main(run_args(tiny_model, small_data, tmp_path, "--trainer.logger.version=v", steps=1))
    before = (tmp_path / "lightning_logs" / "v" / "checkpoints" / "last.ckpt").read_bytes()
    capsys.readouterr()
    code = main(run_args(tiny_model, small_data, tmp_path, "--trainer.logger.version=v", "--ckpt_path=last", change,
                         steps=2))
    err = capsys.readouterr().err
    assert code == 1
    error = [line for line in err.splitlines() if line.startswith("rlflow: error:")]
    assert len(error) == 1 and shown in error[0] and "Traceback" not in err, err
    assert (tmp_path / "lightning_logs" / "v" / "checkpoints" / "last.ckpt").read_bytes() == before


def test_last_without_a_checkpoint_says_so_and_starts_fresh(tiny_model, small_data, tmp_path, one_thread, caplog):
    with caplog.at_level(logging.INFO, logger="rlflow"):
        cli = cli_main(run_args(tiny_model, small_data, tmp_path, "--ckpt_path=last", steps=1))
    assert cli.trainer.global_step == 1 and cli.trainer.ckpt_path is None
    lines = [r.getMessage() for r in caplog.records if "no checkpoint of this run" in r.getMessage()]
    assert len(lines) == 1 and "training starts from step 0" in lines[0], caplog.text


def test_a_truncated_last_checkpoint_falls_back_to_the_newest_intact_one(
    tiny_model, small_data, tmp_path, one_thread, caplog, capsys
):
    straight, chained = tmp_path / "straight", tmp_path / "chained"
    cli_main(run_args(tiny_model, small_data, straight, steps=4))
    cli_main(run_args(tiny_model, small_data, chained, steps=3))
    checkpoints = chained / "lightning_logs" / "version_0" / "checkpoints"
    last, intact = checkpoints / "last.ckpt", checkpoints / "epoch=1-step=3.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # a torn copy, a disk error

    # named explicitly, it is one line saying so
    capsys.readouterr()
    assert main(run_args(tiny_model, small_data, chained, f"--ckpt_path={last}", steps=4)) == 1
    err = capsys.readouterr().err
    assert f"rlflow: error: --ckpt_path {last} cannot be read" in err and "Traceback" not in err, err

    with caplog.at_level(logging.INFO, logger="rlflow"):
        cli = cli_main(run_args(tiny_model, small_data, chained, "--ckpt_path=last", steps=4))
    assert Path(cli.trainer.ckpt_path) == intact
    lines = [r.getMessage() for r in caplog.records if "truncated or corrupt" in r.getMessage()]
    assert len(lines) == 1 and str(last) in lines[0] and str(intact) in lines[0], caplog.text
    assert_same_run(straight, chained, 4)
    assert_same_final_state(straight, chained, 4)
