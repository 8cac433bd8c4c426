"""DAPO dynamic sampling in ``rlflow fit``: the run drops agreeing groups and logs the ``sampling/*`` counts."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests.helpers.fit import fit_args


@pytest.mark.slow
def test_fit_with_dynamic_sampling(tiny_model, tiny_data, tmp_path):
    from rlflow.cli import cli_main

    cli = cli_main(
        fit_args(
            tiny_model,
            tiny_data,
            tmp_path,
            "--model.loss=dapo",
            "--data.filtering.dynamic_sampling=true",
            "--data.filtering.max_rounds=2",
            steps=2,
        )
    )
    rows = [r for r in csv.DictReader(open(Path(cli.trainer.log_dir) / "metrics.csv")) if r.get("sampling/rounds")]
    assert len(rows) == 2
    for r in rows:
        rounds = float(r["sampling/rounds"])
        assert 1 <= rounds <= 2 and float(r["sampling/groups_drawn"]) == 4 * rounds
        assert 0 <= float(r["sampling/groups_padded"]) <= 4
