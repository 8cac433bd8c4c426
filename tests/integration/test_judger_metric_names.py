"""A judger's ``log_metric`` named like a training metric (``loss``, ``entropy``): the training metric is logged,
and the judger's value is warned about once per name and run, never written in its place."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from rlflow.cli import cli_main
from tests.helpers.fit import fit_args

pytestmark = pytest.mark.slow

JUDGER_VALUE = 1234.0


def logs_training_names(completions, log_metric, **kwargs):
    log_metric("loss", JUDGER_VALUE)
    log_metric("entropy", JUDGER_VALUE)
    log_metric("judge/own", 0.5)
    return [0.0] * len(completions)


def test_a_judger_metric_named_like_a_training_metric_is_warned_about_and_not_logged(
        tiny_model, tiny_data, tmp_path, caplog):
    judgers = {"*": ["gsm8k", "tests.integration.test_judger_metric_names:logs_training_names"]}
    with caplog.at_level("WARNING"):
        cli = cli_main(fit_args(tiny_model, tiny_data, tmp_path, f"--data.judging.judgers={json.dumps(judgers)}",
                                "--summary.enabled=false", "--model.export_hf=false",
                                "--data.judging.isolation=thread", steps=2))
    with open(Path(cli.trainer.log_dir) / "metrics.csv") as f:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    assert len(rows) == 2
    for row in rows:
        assert row["judge/own"] == 0.5  # a name of its own is logged
        assert row["loss"] != JUDGER_VALUE and row["entropy"] != JUDGER_VALUE
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    for name in ("loss", "entropy"):
        assert sum(f"a judger's log_metric({name!r}, ...) is not logged: {name!r} is a training metric" in w
                   for w in warnings) == 1, warnings
