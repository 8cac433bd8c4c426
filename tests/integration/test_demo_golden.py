"""The CPU demo's first 10 rollout steps log the metrics of a checked-in record
(``tests/data/demo_first_10_steps_<capability>.csv``).

The record was written by ``rlflow fit --config configs/demo_cpu.yaml --trainer.max_steps 10`` on the model that
``tools/make_tiny_model.py`` builds (seed 0): any change to sampling, judging, advantages, packing, the loss or the
optimizer moves these values, so a refactor that keeps them keeps the behaviour users see.

torch's CPU kernels sum in another order on each instruction set (``torch.backends.cpu.get_cpu_capability()``:
AVX2, AVX512, ...), and MKL's matrix products take other kernels on each vendor's CPUs (an Intel and an AMD AVX512
machine log different rewards from the first step), which moves the warm-up's weights and then every sampled token:
one record per kind of machine (instruction set and vendor: ``avx512_intel``), each reproduced exactly on a machine
of its kind, run to run. A machine of a kind with no record skips, naming it; writing the record is the command
above with ``--trainer.logger.init_args.save_dir``, keeping the columns of the other records.
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


def machine_kind() -> str:
    """This machine's instruction set (torch's CPU capability) and CPU vendor: ``avx2_amd``, ``avx512_intel``, ..."""
    import torch

    vendors = {"GenuineIntel": "intel", "AuthenticAMD": "amd"}
    vendor = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            vendor = next((line.split(":", 1)[1].strip() for line in f if line.startswith("vendor_id")), vendor)
    except OSError:
        pass
    return f"{torch.backends.cpu.get_cpu_capability().lower()}_{vendors.get(vendor, vendor.lower())}"


def record() -> Path:
    """The record of this machine's kind; a skip where there is none."""
    kind = machine_kind()
    path = DATA / f"demo_first_10_steps_{kind}.csv"
    if not path.exists():
        have = sorted(p.stem.removeprefix("demo_first_10_steps_") for p in DATA.glob("demo_first_10_steps_*.csv"))
        pytest.skip(f"no record of the demo's first 10 steps for this kind of machine, {kind} (records: {have})")
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
