"""Rollout/training mismatch correction (TIS/MIS) wired into ``rlflow fit``: the sampling metrics are logged."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests.helpers.fit import fit_args


@pytest.mark.slow
def test_fit_logs_the_sampling_metrics(tiny_model, tiny_data, tmp_path):
    from rlflow.cli import cli_main

    cli = cli_main(fit_args(tiny_model, tiny_data, tmp_path, "--model.rollout_correction.mode=sequence_mask",
                            "--model.rollout_correction.cap=3.0", steps=2))
    rows = [r for r in csv.DictReader(open(Path(cli.trainer.log_dir) / "metrics.csv"))]
    names = ("sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
             "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
             "sampling/importance_sampling_ratio/max")
    logged = [r for r in rows if r.get(names[0])]
    assert len(logged) == 2
    for r in logged:
        # the HF backend samples with the same weights and kernels it trains with: the engines agree
        assert float(r["sampling/sampling_logp_difference/max"]) < 1e-3
        assert 0.99 < float(r["sampling/importance_sampling_ratio/mean"]) < 1.01

