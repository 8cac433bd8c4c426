"""``rlflow fit`` with packing and the ``engine`` backend."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from tests.helpers.fit import fit_args


@pytest.mark.slow
def test_fit_with_packing_and_the_engine_backend(tiny_model, tiny_data, tmp_path):
    from rlflow.cli import cli_main

    cli = cli_main(
        fit_args(
            tiny_model,
            tiny_data,
            tmp_path,
            "--model.update.packing=true",
            "--model.update.pack_max_length=200",
            "--data.rollout=engine",
            "--model.update.optimizer_steps=2",
            steps=1,
        )
    )
    # one rollout step of 2 optimizer steps (old log-probs from packs)
    assert cli.trainer.global_step == 1 and cli.model.policy_version == 2
    (metrics,) = Path(cli.trainer.log_dir).glob("metrics.csv")
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("loss")]
    assert rows and all(float(r["completions/mean_length"]) <= 12 for r in rows)
    assert all(torch.isfinite(torch.tensor(float(r["loss"]))) for r in rows)
