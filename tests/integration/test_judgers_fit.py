"""A TRL reward function named by dotted path, trained end to end with ``rlflow fit``."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.helpers.fit import fit_args
from tests.unit.judgers.test_judgers import dapo_soft_overlong


# ------------------------------------------------------------------------------------------- end to end
def read_metrics(log_dir: Path) -> list[dict[str, float]]:
    with open(log_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


@pytest.mark.slow
def test_trl_reward_function_from_a_dotted_path_trains(tiny_model, tiny_data, tmp_path):
    from rlflow.cli import cli_main

    judgers = {"*": [{"class_path": "function", "init_args": {"path": "tests.helpers.reward_helpers:reward_len"}},
                     "overlong"]}
    cli = cli_main(fit_args(tiny_model, tiny_data, tmp_path, f"--data.judging.judgers={json.dumps(judgers)}",
                            "--data.judging.timeout=30", steps=2))
    assert cli.trainer.global_step == 2
    log_dir = Path(cli.trainer.log_dir)
    rows = read_metrics(log_dir)
    for key in ("rewards/reward_len/mean", "rewards/reward_len/std", "rewards/overlong/mean", "judger/failures",
                "grad_norm"):
        assert key in rows[-1], key
    assert rows[-1]["judger/failures"] == 0
    # every logged reward is reward_len + DAPO's penalty with data.sampling.max_tokens=12 (a fifth, 2 tokens, of
    # buffer),
    # recomputed here from the completion text and token count
    lines = [json.loads(l) for l in (log_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 4 * 4
    for line in lines:
        expected = -abs(5 - len(line["completion"])) / 10 + dapo_soft_overlong(line["num_tokens"], 12, 2)
        assert line["reward"] == pytest.approx(expected), line
    means = [sum(l["reward"] for l in lines if l["step"] == s) / 16 for s in (0, 1)]
    assert [r["reward"] for r in rows] == pytest.approx(means)
