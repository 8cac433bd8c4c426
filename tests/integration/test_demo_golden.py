"""The CPU demo's first 10 rollout steps log the metrics of a checked-in record
(``tests/data/demo_first_10_steps_<capability>.csv``).

The record was written by ``rlflow fit --config configs/demo_cpu.yaml --trainer.max_steps 10`` on the model that
``tools/make_tiny_model.py`` builds (seed 0): any change to sampling, judging, advantages, packing, the loss or the
optimizer moves these values, so a refactor that keeps them keeps the behaviour users see.

torch's CPU kernels sum in another order on each instruction set (``torch.backends.cpu.get_cpu_capability()``:
AVX2, AVX512, ...), which moves the warm-up's weights and then every sampled token: one record per instruction set,
each reproduced exactly on a machine of its kind, run to run. A machine whose instruction set has no record skips,
naming it; writing the record is the command above with ``--trainer.logger.init_args.save_dir``, keeping the
columns of the other records.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.demo_model import demo_model
from tests.helpers.paths import DATA, ROOT


def record() -> Path:
    """The record of this machine's instruction set; a skip where there is none."""
    import torch

    capability = torch.backends.cpu.get_cpu_capability()
    path = DATA / f"demo_first_10_steps_{capability.lower()}.csv"
    if not path.exists():
        have = sorted(p.stem.rsplit("_", 1)[1].upper() for p in DATA.glob("demo_first_10_steps_*.csv"))
        pytest.skip(f"no record of the demo's first 10 steps for CPU capability {capability} (records: {have})")
    return path


def read(path: Path) -> list[dict[str, str]]:
    return [row for row in csv.DictReader(path.open()) if row.get("reward")]


@pytest.mark.slow
def test_demo_config_reproduces_the_recorded_first_10_steps(tmp_path, tmp_path_factory):
    recorded = read(record())
    model, data = demo_model(tmp_path_factory)  # tools/make_tiny_model.py's build, shared by the session
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "rlflow", "fit", "--config", "configs/demo_cpu.yaml",
                    "--trainer.max_steps", "10", "--trainer.enable_progress_bar", "false",
                    "--trainer.logger.init_args.save_dir", str(tmp_path / "runs"), "--model.export_hf", "false",
                    "--model.model_path", str(model), "--data.train_data_path", str(data / "train.jsonl"),
                    "--data.eval_data_path", str(data / "val.jsonl")],
                   check=True, cwd=ROOT, env=env, capture_output=True, timeout=600)
    logged = read(next((tmp_path / "runs").glob("demo/version_*/metrics.csv")))
    assert len(logged) == len(recorded) == 10
    for got, want in zip(logged, recorded):
        for key, value in want.items():
            assert float(got[key]) == pytest.approx(float(value), rel=1e-5, abs=1e-7), (want["step"], key)
