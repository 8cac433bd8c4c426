"""A missing demo model through ``rlflow fit`` fails fast, naming how to build it."""

from __future__ import annotations

import time

import pytest

from rlflow.models import model_path
from tests.helpers.fit import fit_args

BUILD = "python tools/make_tiny_model.py --out checkpoints/tiny-qwen3 --data-out checkpoints/arith"


@pytest.fixture
def no_hub(monkeypatch):
    """The hub cannot be reached (as on this machine), whatever the network of the test machine."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(model_path, "hub_reachable", lambda *a, **k: False)
    monkeypatch.setattr(model_path, "in_hf_cache", lambda repo_id: False)


def test_missing_demo_model_fails_fast_through_the_cli(tiny_model, tiny_data, tmp_path, monkeypatch, no_hub, capsys):
    from rlflow.cli import main

    monkeypatch.chdir(tmp_path)  # no checkpoints/ here: 'checkpoints/tiny-qwen3' looks like a hub id
    args = fit_args(tiny_model, tiny_data, tmp_path / "run", steps=1)
    args = [a for a in args if not a.startswith("--model.model_path")]
    start = time.perf_counter()
    code = main([*args, "--model.model_path=checkpoints/tiny-qwen3"])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert code == 1 and elapsed < 10.0, (elapsed, err)  # the hub's retries took ~50 s
    line = next(line for line in err.splitlines() if line.startswith("rlflow: error:"))
    assert line == (f"rlflow: error: model.model_path 'checkpoints/tiny-qwen3' does not exist; build it with "
                    f"'{BUILD}'")
    assert "Traceback" not in err

