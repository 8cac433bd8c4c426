"""tools/setup_env.sh: what it installs, with which installer, and the fallback to pip, run against a stand-in venv
whose ``python`` records each call instead of installing anything."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers.paths import ROOT

FAKE_PYTHON = """#!/usr/bin/env python3
import json, os, sys
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write(json.dumps({"args": args, "no_bytecode": os.environ.get("PYTHONDONTWRITEBYTECODE")}) + "\\n")
if args[:5] == ["-m", "pip", "install", "-q", "--no-compile"] and args[5:] == ["uv"] and os.environ.get("FAKE_NO_UV"):
    sys.exit(1)  # no uv on this index
if args[:2] == ["-m", "uv"] and os.environ.get("FAKE_UV_FAILS"):
    sys.exit(2)
"""

PLUGINS = sorted(f"plugins/{p.name}/" for p in (ROOT / "plugins").iterdir() if (p / "pyproject.toml").exists())
PACKAGES = ["-e", ".[dev]"] + [arg for plugin in PLUGINS for arg in ("-e", plugin)]


def run_setup(tmp_path: Path, **env: str) -> list[dict]:
    """Run tools/setup_env.sh against a stand-in venv under ``tmp_path``; the calls its ``python`` received."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    python = venv / "bin" / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(0o755)
    (venv / "bin" / "activate").write_text(f'PATH="{venv / "bin"}:$PATH"; export PATH\n')
    log = tmp_path / "calls.jsonl"
    log.unlink(missing_ok=True)
    run_env = {k: v for k, v in os.environ.items() if k not in ("RLFLOW_TORCH", "RLFLOW_NO_UV")}
    run_env |= {"RLFLOW_VENV": str(venv), "FAKE_LOG": str(log), "PYTHONDONTWRITEBYTECODE": "1", **env}
    subprocess.run(["bash", str(ROOT / "tools" / "setup_env.sh")], env=run_env, check=True, capture_output=True,
                   timeout=60)
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture(autouse=True)
def bubblewrap_present():
    """The script would install bubblewrap through apt where it is missing: not what these tests are about."""
    if subprocess.run(["bash", "-c", "command -v bwrap"], capture_output=True).returncode != 0:
        pytest.skip("bwrap is not installed here; tools/setup_env.sh would apt-get it")


def test_torch_through_pip_then_everything_else_in_one_uv_call_then_the_bytecode_of_the_fit_imports(tmp_path):
    calls = run_setup(tmp_path)
    args = [c["args"] for c in calls]
    assert args[0] == ["-m", "pip", "install", "-q", "--no-compile", "torch==2.13.0"]
    assert args[1] == ["-m", "pip", "install", "-q", "--no-compile", "uv"]
    assert args[2] == ["-m", "uv", "pip", "install", "-q", "--python", str(tmp_path / "venv" / "bin" / "python"),
                       *PACKAGES]
    assert args[3][0] == "-c" and "import rlflow.cli" in args[3][1]
    assert calls[3]["no_bytecode"] is None  # written even where the environment says not to
    assert len(calls) == 4  # no pip install of the packages beside uv's


def test_pip_installs_the_same_packages_in_one_call_where_uv_cannot_be_installed_or_fails(tmp_path):
    for env in ({"FAKE_NO_UV": "1"}, {"FAKE_UV_FAILS": "1"}):
        args = [c["args"] for c in run_setup(tmp_path / next(iter(env)), **env)]
        assert ["-m", "pip", "install", "-q", "--no-compile", *PACKAGES] in args, env
        assert args[-1][0] == "-c"


def test_rlflow_no_uv_installs_through_pip_only_and_rlflow_torch_names_the_torch_requirement(tmp_path):
    args = [c["args"] for c in run_setup(tmp_path, RLFLOW_NO_UV="1", RLFLOW_TORCH="torch==2.13.0+cu128")]
    assert args[0][-1] == "torch==2.13.0+cu128"
    assert not any("uv" in a for a in args)
    assert args[1] == ["-m", "pip", "install", "-q", "--no-compile", *PACKAGES]


def test_a_second_run_installs_nothing_until_the_torch_requirement_changes(tmp_path):
    assert len(run_setup(tmp_path)) == 4
    assert run_setup(tmp_path) == []
    assert run_setup(tmp_path, RLFLOW_TORCH="torch==2.12.0")[0]["args"][-1] == "torch==2.12.0"
