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


def test_lightnings_service_tips_are_dropped_and_its_other_messages_kept():
    """Lightning logs a "Tip" for litlogger at every Trainer set-up (seen first without rlflow); with rlflow's
    logging set up it is gone, and another rank-zero message through the same logger still shows."""
    trainer = ("import lightning as L; L.Trainer(accelerator='cpu', logger=L.pytorch.loggers.CSVLogger('{dir}'), "
               "enable_checkpointing=False, enable_progress_bar=False); "
               "from lightning.pytorch.utilities.rank_zero import rank_zero_info; rank_zero_info('still shown')")

    def output(code: str) -> str:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        return done.stdout + done.stderr

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        loud = output(trainer.format(dir=tmp))
        if "Tip:" not in loud:
            pytest.skip("this Lightning prints no service tip: nothing to drop")
        quiet = output("import rlflow.log; " + trainer.format(dir=tmp))
    assert "still shown" in loud and "still shown" in quiet
    assert "Tip:" not in quiet, quiet[-2000:]
