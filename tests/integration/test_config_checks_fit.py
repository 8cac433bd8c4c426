"""Through ``rlflow fit``: every invalid value is one ``rlflow: error:`` line naming the option, raised before anything
slow, in this process and from the console script."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlflow.cli import main  # Lightning imported here, before any test captures stdout (its log handler keeps it)
from tests.helpers.fit import fit_args
from tests.helpers.paths import ROOT

BAD_VALUES = [
    ("data.sampling.max_tokens", "0", "data.sampling.max_tokens must be >= 1, got 0"),
    ("data.sampling.temperature", "-1", "data.sampling.temperature must be >= 0"),
    ("data.sampling.top_p", "0", "data.sampling.top_p must be in (0.0, 1.0]"),
    ("data.sampling.top_p", "1.5", "data.sampling.top_p must be in (0.0, 1.0]"),
    ("data.sampling.top_k", "-1", "data.sampling.top_k must be >= 0"),
    ("data.sampling.min_p", "1.0", "data.sampling.min_p must be in [0.0, 1.0)"),
    ("data.sampling.repetition_penalty", "0", "data.sampling.repetition_penalty must be > 0.0, got 0"),
    ("data.prompt_repeat_k", "1", "data.prompt_repeat_k must be >= 2"),
    ("data.global_batch_size", "0", "data.global_batch_size must be >= 1"),
    ("model.optim.lr", "0", "model.optim.lr must be > 0"),
    ("model.optim.lr", "-1e-6", "model.optim.lr must be > 0"),
    ("model.update.optimizer_steps", "0", "model.update.optimizer_steps must be an integer >= 1, got 0"),
    ("model.update.micro_batch_size", "0", "model.update.micro_batch_size must be an integer >= 1, got 0"),
    ("model.loss.init_args.epsilon_low", "1.5",
     "model.loss (rlflow.losses.clipped.BNPOLoss): epsilon_low must be in [0, 1), got 1.5"),
    ("model.loss.init_args.epsilon_high", "-0.1",
     "model.loss (rlflow.losses.clipped.BNPOLoss): epsilon_high must be >= 0, got -0.1"),
]


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("rlflow: error:")]


@pytest.mark.parametrize(("key", "value", "message"), BAD_VALUES)
def test_each_invalid_value_is_one_error_line_naming_the_option(
    key, value, message, tiny_model, tiny_data, tmp_path, capsys
):
    code = main(fit_args(tiny_model, tiny_data, tmp_path, f"--{key}={value}", steps=1))
    err = capsys.readouterr().err
    assert code == 1
    lines = error_lines(err)
    assert len(lines) == 1 and message in lines[0], err
    assert "Traceback" not in err
    assert not list(tmp_path.rglob("*.ckpt"))  # it failed before training


def test_console_script_prints_one_line_and_exits_1(tiny_model, tiny_data, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlflow",
            *fit_args(tiny_model, tiny_data, tmp_path, "--data.sampling.max_tokens=0", steps=1),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert out.returncode == 1, out.stderr
    assert error_lines(out.stderr) == ["rlflow: error: data.sampling.max_tokens must be >= 1, got 0"]
    assert "Traceback" not in out.stderr
