"""The CPU demo's warm-started tiny Qwen3 and its arithmetic data, built once per test session.

``tools/make_tiny_model.py`` (a few minutes of supervised warm-up on two CPU cores) writes them under pytest's base
temporary directory, shared by pytest-xdist's workers: the first worker that asks builds under a file lock, the
others wait for it; every test that trains ``configs/demo_cpu.yaml`` as shipped uses that one build.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers.paths import ROOT


def demo_model(tmp_path_factory) -> tuple[Path, Path]:
    """``(model, data)``: the directories ``tools/make_tiny_model.py --eval-prompts 0`` builds, as ``tools/demo.sh``
    does for ``checkpoints/tiny-qwen3`` and ``checkpoints/arith``; built by the first test of the session that asks."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "demo"
    root.mkdir(parents=True, exist_ok=True)
    model, data = root / "tiny-qwen3", root / "arith"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build; a second worker waits here, idle
        if not ((model / "model.safetensors").exists() and (data / "val.jsonl").exists()):
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--out", str(model),
                            "--data-out", str(data), "--eval-prompts", "0", "--force"], check=True, cwd=ROOT,
                           env=env, capture_output=True, timeout=1200)
    return model, data
