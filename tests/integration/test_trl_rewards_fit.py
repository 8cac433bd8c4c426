"""``rlflow fit`` with reward functions as TRL users have them, unchanged: TRL's own ``trl.rewards``
(``accuracy_reward``, ``think_format_reward``, ``get_soft_overlong_punishment(...)``) and a curriculum written to
TRL's documented signature (``trainer_state``, ``log_extra``, ``log_metric``), on a dataset in TRL's conversational
layout (``prompt``, ``solution``). A judger that cannot work stops the run at its first step with one line; one
that fails now and then does not."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlflow.cli import cli_main, main
from tests.helpers.fit import fit_args
from tests.helpers.processes import rlflow_env

pytest.importorskip("trl.rewards", reason="TRL is not installed (pip install --no-deps trl; it is in the dev extra)")
pytest.importorskip("math_verify", reason="trl.rewards.accuracy_reward needs math_verify")

pytestmark = pytest.mark.slow

HELPERS = "tests.helpers.trl_rewards"
FLAKY = {"class_path": "function", "init_args": {"path": f"{HELPERS}:make_flaky", "factory_kwargs": {"every": 20}}}


def trl_dataset(tiny_data: Path, root: Path) -> Path:
    """The tiny arithmetic prompts in TRL's conversational layout: ``prompt`` messages and a ``solution``."""
    rows = [json.loads(line) for line in (tiny_data / "train.jsonl").read_text().splitlines()[:16]]
    root.mkdir(parents=True, exist_ok=True)
    path = root / "trl_train.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "solution": r["reward_model"]["ground_truth"]}) + "\n"
                            for r in rows))
    return path


def run_args(tiny_model, tiny_data, root, judgers, *extra, steps=3):
    args = [a for a in fit_args(tiny_model, tiny_data, root, f"--data.judging.judgers={json.dumps(judgers)}",
                                "--summary.enabled=false", "--model.export_hf=false", *extra, steps=steps)
            if not a.startswith("--data.train_data_path")]
    return [*args, f"--data.train_data_path={trl_dataset(tiny_data, root)}"]


def read_metrics(log_dir: Path) -> list[dict[str, float]]:
    with open(log_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def test_trl_reward_functions_and_a_curriculum_train_unchanged(tiny_model, tiny_data, tmp_path):
    judgers = {"*": ["trl.rewards:accuracy_reward", "trl.rewards:think_format_reward", f"{HELPERS}:soft_overlong",
                     f"{HELPERS}:curriculum", FLAKY]}
    cli = cli_main(run_args(tiny_model, tiny_data, tmp_path, judgers))
    assert cli.trainer.global_step == 3
    log_dir = Path(cli.trainer.log_dir)
    metrics = read_metrics(log_dir)
    for name in ("accuracy_reward", "think_format_reward", "soft_overlong_punishment_reward", "curriculum"):
        assert f"rewards/{name}/mean" in metrics[-1], name  # TRL's metric names
    # log_metric: averaged per rollout step, beside the built-in metrics; the curriculum's level follows the step
    assert [m["curriculum/level"] for m in metrics] == pytest.approx([0.0, 1 / 3, 2 / 3])
    assert metrics[0]["rewards/curriculum/mean"] == 0.0 and metrics[2]["rewards/curriculum/mean"] > 0.0
    # the flaky judger failed on every 20th sample: 2 of the 48, one in each of two steps; the run went on
    assert sum(m["judger/failures"] for m in metrics) == 2
    rows = [json.loads(line) for line in (log_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * 16
    for row in rows:
        # log_extra columns: the curriculum's, and those trl.rewards.accuracy_reward logs itself
        assert row["curriculum_level"] == pytest.approx(row["step"] / 3) and row["process_zero"] is True
        assert row["gold_parsed"] == f"[{row['solution']}, '{row['solution']}']"  # e.g. "8" and "[8, '8']"
        assert "answer_parsed" in row
    # the reward, recomputed: TRL's overlong penalty + the curriculum (step / 3 x length / 12), where accuracy and
    # think format give 0 (no answer parsed, no <think> block) and the flaky judger did not fail
    plain = [r for r in rows if r["answer_parsed"] == "[unparseable]" and "<think>" not in r["completion"]
             and not r.get("judgers_failed")]
    assert {r["step"] for r in plain} == {0, 1, 2}
    for r in plain:
        n = r["num_tokens"]
        overlong = 0.0 if n <= 8 else (8 - n) / 4
        assert r["reward"] == pytest.approx(overlong + r["step"] / 3 * n / 12, abs=1e-6), r


def test_a_judger_with_a_wrong_signature_stops_the_run_before_generation(tiny_model, tiny_data, tmp_path, capsys):
    """``completion`` (for ``completions``) is a parameter no keyword and no column fills: refused at startup."""
    judgers = {"*": ["trl.rewards:think_format_reward", f"{HELPERS}:wrong_signature"]}
    code = main(run_args(tiny_model, tiny_data, tmp_path, judgers))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlflow: error:")]
    assert code == 1 and len(lines) == 1, err
    assert lines[0].startswith("rlflow: error: train data: judger 'wrong_signature' requires the parameter(s) "
                               "completion, which no train row it judges has as a column (columns: "), lines
    assert "solution" in lines[0] and "think_format_reward" not in lines[0]
    assert "Traceback" not in err
    assert not list(tmp_path.rglob("*.ckpt"))  # nothing was trained


def test_max_failure_rate_stops_a_judger_failing_more_often(tiny_model, tiny_data, tmp_path, capsys):
    judgers = {"*": ["trl.rewards:think_format_reward", FLAKY]}
    code = main(run_args(tiny_model, tiny_data, tmp_path, judgers, "--data.judging.max_failure_rate=0.05"))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlflow: error:")]
    # 1 of 16 is more than 5%: the step of the 20th sample stops the run
    assert code == 1 and lines == [
        "rlflow: error: rollout step 1: judger 'flaky' failed on 1 of its 16 samples (more than "
        "data.judging.max_failure_rate=0.05): ValueError: it returned inf for 1 sample(s); infinite rewards count as "
        "failed; it was given the keywords prompts, completions, completion_ids, solution, trainer_state, log_extra, "
        "log_metric"]


def two_ranks(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``rlflow`` on 2 gloo ranks under FSDP2 (Lightning's launcher starts the second)."""
    args = [a.replace("--trainer.devices=1", "--trainer.devices=2") for a in args]
    env = rlflow_env()
    return subprocess.run([sys.executable, "-m", "rlflow", *args, "--trainer.strategy=fsdp"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_under_fsdp2_on_two_ranks(tiny_model, tiny_data, tmp_path):
    """Each rank's judgers get its own ``trainer_state``; ``log_metric`` is averaged over ranks, ``log_extra``
    columns are in each rank's trajectories; a judger that cannot work stops both ranks at the same step."""
    run = two_ranks(run_args(tiny_model, tiny_data, tmp_path / "ok", {"*": [f"{HELPERS}:curriculum"]}, steps=2),
                    tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    log_dir = tmp_path / "ok" / "lightning_logs" / "version_0"
    assert [m["curriculum/level"] for m in read_metrics(log_dir)] == pytest.approx([0.0, 0.5])
    for name, first in (("trajectories.jsonl", True), ("trajectories.rank1.jsonl", False)):
        rows = [json.loads(line) for line in (log_dir / name).read_text().splitlines()]
        assert len(rows) == 2 * 2 * 4  # 2 steps x 2 prompts x 4 completions on each rank
        assert all(r["process_zero"] is first and r["curriculum_level"] == r["step"] / 2 for r in rows)

    bad = {"*": ["trl.rewards:think_format_reward", f"{HELPERS}:cannot_score"]}
    run = two_ranks(run_args(tiny_model, tiny_data, tmp_path / "bad", bad, steps=2), tmp_path)
    lines = [line for line in run.stderr.splitlines() if line.startswith("rlflow: error:")]
    assert run.returncode == 1 and lines, run.stderr[-4000:]
    assert all(line.startswith("rlflow: error: rollout step 0: judger 'cannot_score' failed on 8 of its 8 "
                               "samples: TypeError:") for line in lines), lines
