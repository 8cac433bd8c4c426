"""``rlflow fit`` with a TRL-style reward function that hangs at the first step: its worker process is killed at
``data.judging.timeout`` (``judger/killed_workers``), those samples count as failed, and the next step's calls,
in a fresh worker, score; the workers end with the run."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from rlflow.cli import cli_main
from tests.helpers import hostile
from tests.helpers.fit import fit_args

pytestmark = pytest.mark.slow


def test_a_hanging_reward_function_is_killed_and_the_run_goes_on(tiny_model, tiny_data, tmp_path, monkeypatch):
    pidfile = tmp_path / "pids"
    monkeypatch.setenv("RLFLOW_TEST_PIDFILE", str(pidfile))  # the workers get the trainer's environment
    judgers = {"*": ["tests.helpers.hostile:hangs_at_the_first_step", "overlong"]}
    cli = cli_main(fit_args(tiny_model, tiny_data, tmp_path, f"--data.judging.judgers={json.dumps(judgers)}",
                            "--data.judging.timeout=2", "--data.judging.max_failure_rate=1.0", steps=2))
    assert cli.trainer.global_step == 2
    log_dir = Path(cli.trainer.log_dir)
    with open(log_dir / "metrics.csv") as f:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    assert rows[0]["judger/killed_workers"] > 0 and rows[0]["judger/failures"] == 16
    assert rows[0]["judger/abandoned_threads"] == 0
    assert rows[1]["judger/killed_workers"] == 0 and rows[1]["judger/failures"] == 0
    assert rows[1]["rewards/hangs_at_the_first_step/mean"] < 0
    lines = [json.loads(line) for line in (log_dir / "trajectories.jsonl").read_text().splitlines()]
    assert all(("hangs_at_the_first_step" in line.get("judgers_failed", ())) == (line["step"] == 0) for line in lines)
    pids = hostile.read_pids(pidfile)
    killed = sorted(set(pids[:-1]) - {pids[-1]})  # the workers of step 0; the last one served step 1
    assert killed and hostile.all_gone(killed)
    assert hostile.all_gone(pids[-1:])  # the worker of the last step ended with the run, not with the process
