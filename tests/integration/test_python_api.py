"""The README's Python API block runs as written: GRPOModule + RolloutDataModule + lightning.Trainer, no CLI."""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path

from tests.helpers.paths import ROOT


def readme_block(title: str) -> str:
    """The first ```python block under the README heading ``title``."""
    text = (ROOT / "README.md").read_text()
    section = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_readme_python_api_trains(tiny_model, tiny_data, tmp_path, monkeypatch):
    (tmp_path / "checkpoints").mkdir()
    os.symlink(tiny_model, tmp_path / "checkpoints" / "tiny-qwen3")
    os.symlink(tiny_data, tmp_path / "checkpoints" / "arith")
    monkeypatch.chdir(tmp_path)
    code = readme_block("Python API")
    assert "trainer.fit(model, datamodule=data)" in code
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    trainer = scope["trainer"]
    assert trainer.global_step == 3
    (metrics,) = Path("runs/python_api").rglob("metrics.csv")
    rows = [r for r in csv.DictReader(open(metrics)) if r.get("reward")]
    assert [int(r["step"]) for r in rows] == [0, 1, 2]
    assert all(0.0 <= float(r["reward"]) <= 1.0 for r in rows)
    trajectories = list(Path("runs/python_api").rglob("trajectories.jsonl"))
    assert trajectories and len(trajectories[0].read_text().splitlines()) == 3 * 16 * 8
    # the checkpoint holds plain values only (the loss object as its class path and arguments), so torch's safe
    # loader reads it, and a new module resumes from it
    import torch
    import yaml

    hparams = yaml.safe_load(next(Path("runs/python_api").rglob("hparams.yaml")).read_text())  # plain data too
    assert hparams["optim"]["lr"] == 1e-4 and hparams["loss"]["class_path"] == "rlflow.losses.clipped.BNPOLoss"
    (last,) = Path("runs/python_api").rglob("last.ckpt")
    state = torch.load(last, weights_only=True, map_location="cpu")
    assert state["hyper_parameters"]["loss"] == {
        "class_path": "rlflow.losses.clipped.BNPOLoss",
        "init_args": {**state["hyper_parameters"]["loss"]["init_args"], "epsilon_high": 0.28}}
    exec(compile(code.replace("max_steps=3", "max_steps=4").replace("trainer.fit(model, datamodule=data)",
                              f"trainer.fit(model, datamodule=data, ckpt_path={str(last)!r})"), "README.md", "exec"),
         scope)
    assert scope["trainer"].global_step == 4


def test_ctrl_c_in_the_readme_script_finishes_the_step_and_saves_it(tiny_model, tiny_data, tmp_path, monkeypatch):
    """With the README's ``GracefulStop``, a Ctrl-C (SIGINT) in the middle of rollout step 2 lets that step finish,
    writes its ``last.ckpt`` and ends ``trainer.fit`` with Lightning's ``SIGTERMException`` (without it, Lightning
    stops at once and exits); the signal handlers are put back."""
    import signal

    import pytest
    import torch
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    (tmp_path / "checkpoints").mkdir()
    os.symlink(tiny_model, tmp_path / "checkpoints" / "tiny-qwen3")
    os.symlink(tiny_data, tmp_path / "checkpoints" / "arith")
    monkeypatch.chdir(tmp_path)
    code = readme_block("Python API")
    callbacks = "callbacks=[TrajectoryWriter(), RLFlowCheckpoint(), GracefulStop()]"
    assert callbacks in code
    code = code.replace(callbacks, callbacks[:-1] + ", SignalMidStep(step=1, signum='SIGINT')]").replace(
        "import lightning as L\n", "import lightning as L\nfrom tests.integration.test_signals import SignalMidStep\n")
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with pytest.raises(SIGTERMException):
        exec(compile(code, "README.md", "exec"), {})
    (last,) = Path("runs/python_api").rglob("last.ckpt")
    assert torch.load(last, weights_only=True, map_location="cpu")["global_step"] == 2  # step 2 whole, not 3
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers
