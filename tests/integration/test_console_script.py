"""The installed ``rlflow`` console script, run from a user's folder: import paths in a config name modules of the
working directory (as with ``python -m rlflow``), and a file there never hides an installed package."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.processes import rlflow_env

SCRIPT = Path(sys.executable).parent / "rlflow"
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="the rlflow console script is not installed here")


def run(args, cwd):
    env = rlflow_env()
    env.pop("PYTHONPATH")  # as a user runs it: nothing but the installed packages and the working directory
    return subprocess.run([str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_a_reward_function_in_the_working_directory_is_found(tiny_model, tiny_data, tmp_path):
    (tmp_path / "my_rewards.py").write_text("def fn(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    (tmp_path / "yaml.py").write_text("raise SystemExit('the working directory hid an installed package')\n")
    out = run(["data", "check", str(tiny_data / "train.jsonl"), "--tokenizer", str(tiny_model),
               "--judgers", json.dumps({"*": "my_rewards:fn"})], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "judgers: * -> fn" in out.stdout


def test_a_module_that_is_nowhere_is_one_line(tiny_model, tiny_data, tmp_path):
    out = run(["data", "check", str(tiny_data / "train.jsonl"), "--tokenizer", str(tiny_model),
               "--judgers", json.dumps({"*": "my_rewardz:fn"})], tmp_path)
    assert out.returncode == 1
    assert out.stderr.strip().splitlines() == [
        "rlflow: error: could not import module 'my_rewardz' for 'my_rewardz:fn': ModuleNotFoundError: No module "
        "named 'my_rewardz'"]


def test_a_reader_that_stops_early_ends_the_command_quietly(tmp_path):
    env = rlflow_env()
    out = subprocess.run(f"'{SCRIPT}' plugins | head -1", shell=True, cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.stdout.startswith("rlflow.")
    assert "Traceback" not in out.stderr and "BrokenPipeError" not in out.stderr, out.stderr
