"""rlflow/quiet.py: the import-time noise of torchao and torch's pytree stays out of every process's output,
the pipelined generator process's included (it calls ``quiet_third_party`` before importing transformers)."""

from __future__ import annotations

import subprocess
import sys

import pytest

NOISE = ("Failed to load", "is an Enum subclass")
IMPORTS = "import torchao"  # what transformers imports when torchao is installed


def stderr_of(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300).stderr


def test_the_generator_process_imports_quietly():
    pytest.importorskip("torchao")
    loud = stderr_of(IMPORTS)
    if not any(n in loud for n in NOISE):
        pytest.skip("this torchao/torch build logs nothing at import: nothing to silence")
    # what worker_main runs first, then the imports that used to print
    quiet = stderr_of(f"from rlflow.rollout.worker import quiet_third_party; quiet_third_party(); {IMPORTS}")
    assert not [n for n in NOISE if n in quiet], quiet[-2000:]
    assert not [n for n in NOISE if n in stderr_of(f"import rlflow.log; {IMPORTS}")]  # the trainer's path
