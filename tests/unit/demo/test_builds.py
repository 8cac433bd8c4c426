"""A shipped config's missing model or data is one line with the command that writes that very path."""

from __future__ import annotations

import shlex

import pytest
import yaml

from rlflow.config_error import ConfigError
from rlflow.data.dataset import DataError
from rlflow.data.sources import resolve
from rlflow.demo.builds import build_command
from rlflow.models.model_path import check_model_path
from tests.helpers.paths import ROOT

LOCAL_CONFIGS = ["demo_cpu", "demo_tools_cpu", "smollm2_gsm8k_cpu", "smollm2_sums_cpu"]


def shipped_paths(name: str) -> list[tuple[str, str]]:
    config = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    paths = [("model.model_path", config["model"]["model_path"])]
    for key in ("train_data_path", "eval_data_path"):
        if config["data"].get(key):
            paths.append((f"data.{key}", config["data"][key]))
    return [(key, path) for key, path in paths if path.startswith("checkpoints/")]


def writes(command: str, path: str) -> bool:
    """Whether ``command``'s ``--out``/``--data-out`` folder is the folder ``path`` lies in (or is)."""
    words = shlex.split(command)
    outs = [words[i + 1] for i, w in enumerate(words[:-1]) if w in ("--out", "--data-out")]
    return any(path == out or path.startswith(out + "/") for out in outs)


@pytest.mark.parametrize("name", LOCAL_CONFIGS)
def test_each_missing_checkpoints_path_names_the_command_that_writes_it(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing is built here
    found = shipped_paths(name)
    assert found or name == "smollm2_gsm8k_cpu"
    for key, path in found:
        command = build_command(path)
        assert command is not None and writes(command, path), (path, command)
        assert (ROOT / shlex.split(command)[1]).exists() or "-m" in command  # a real script
        if key == "model.model_path":
            with pytest.raises(ConfigError, match=f"'{path}' does not exist; build it with '{command}'"):
                check_model_path(path, key)
        else:
            with pytest.raises(DataError, match=f"data file not found; build it with '{command}'"):
                resolve(path)
