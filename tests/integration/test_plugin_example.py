"""The example third-party package ``plugins/rlflow-judger-example``: installed with pip, found through its entry
point, and selected by its short name alone in a real ``rlflow fit``."""

from __future__ import annotations

import csv
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlflow import registry
from tests.helpers.fit import fit_args
from tests.helpers.paths import ROOT

PACKAGE = ROOT / "plugins" / "rlflow-judger-example"


@pytest.fixture(scope="module")
def example_installed():
    """Install the example package (as .ci/run does) unless it already is, then rescan the entry points."""
    try:
        importlib.import_module("rlflow_judger_example")
    except ImportError:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps"]
        out = subprocess.run([*pip, "--no-build-isolation", str(PACKAGE)], capture_output=True, text=True, timeout=300)
        if out.returncode != 0:  # no setuptools in this environment: let pip fetch the build backend
            out = subprocess.run([*pip, str(PACKAGE)], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        importlib.invalidate_caches()
    registry.clear_cache()
    yield
    registry.clear_cache()


def test_the_plugin_is_registered_under_its_own_distribution(example_installed):
    info = registry.discover("rlflow.judgers")["countdown"]
    assert info.distribution == "rlflow-judger-example" and info.version == "0.1.0"
    judger = registry.build("rlflow.judgers", "countdown")
    out = judger(prompts=["p"], completions=["<answer>(25 - 5) * 3</answer>"], target=[60], numbers=[[3, 5, 25]])
    assert out == [1.0]


def write_countdown_data(path: Path) -> Path:
    """Countdown prompts in TRL's layout (plain-string prompts, extra columns for the judger)."""
    rows = []
    for i, (numbers, target) in enumerate([([3, 5, 25], 60), ([2, 7, 9], 23), ([4, 6, 10], 34), ([1, 8, 11], 19)] * 2):
        prompt = f"Use {', '.join(map(str, numbers))} once each to make {target}. Answer as <answer>...</answer>."
        rows.append({"data_source": "countdown", "prompt": prompt, "target": target, "numbers": numbers, "id": i})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_rlflow_fit_selects_the_plugin_by_short_name(example_installed, tiny_model, tiny_data, tmp_path):
    from rlflow.cli import cli_main

    data = write_countdown_data(tmp_path / "countdown.jsonl")
    config = tmp_path / "countdown.yaml"
    config.write_text("data:\n  judging:\n    judgers:\n      countdown: countdown\n")  # the short name, nothing else
    args = [a for a in fit_args(tiny_model, tiny_data, tmp_path, steps=2) if not a.startswith("--data.train_data_path")]
    cli = cli_main([*args, f"--config={config}", f"--data.train_data_path={data}"])
    assert cli.trainer.global_step == 2
    assert type(cli.datamodule.judges.default.judgers["countdown"]).__module__ == "rlflow_judger_example.countdown"
    log_dir = Path(cli.trainer.log_dir)
    with open(log_dir / "metrics.csv") as f:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    assert "rewards/countdown/mean" in rows[-1] and rows[-1]["judger/failures"] == 0
    # every sampled completion was scored by the plugin: its rewards are only ever 0, 0.1 (format) or 1
    from rlflow_judger_example.countdown import CountdownJudger

    lines = [json.loads(l) for l in (log_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len(lines) == 2 * 4 * 4
    judger = CountdownJudger()
    for line in lines:
        assert line["data_source"] == "countdown"
        numbers = next(n for n, t in [([3, 5, 25], 60), ([2, 7, 9], 23), ([4, 6, 10], 34), ([1, 8, 11], 19)]
                       if f"make {t}." in line["prompt"])
        target = int(line["prompt"].split("make ")[1].split(".")[0])
        assert line["reward"] == judger.score(line["completion"], target=target, numbers=numbers)
