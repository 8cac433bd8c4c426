"""``rlflow fit`` for one step with the ``reward_model`` judger."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.helpers.fit import fit_args
from tests.unit.judgers.test_reward_model import save_reward_model


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory) -> Path:
    return save_reward_model(tmp_path_factory.mktemp("rm") / "model")


@pytest.mark.slow
def test_fit_one_step_with_the_reward_model_as_a_judger(rm_path, tiny_model, tiny_data, tmp_path):
    from rlflow.cli import cli_main

    judgers = {
        "*": ["gsm8k", {"class_path": "reward_model", "init_args": {"model_path": str(rm_path), "batch_size": 4}}]
    }
    cli = cli_main(fit_args(tiny_model, tiny_data, tmp_path, f"--data.judging.judgers={json.dumps(judgers)}",
                            '--data.judging.weights={"reward_model": 0.5}', steps=1))
    assert cli.trainer.global_step == 1
    with open(Path(cli.trainer.log_dir) / "metrics.csv") as f:
        row = {k: float(v) for k, v in next(csv.DictReader(f)).items() if v != ""}
    assert row["judger/failures"] == 0 and "rewards/gsm8k/mean" in row
    assert row["rewards/reward_model/mean"] != 0.0 and row["rewards/reward_model/std"] > 0.0

