"""Every shipped config loads (``rlflow fit --config X --print_config``), and ``--help`` documents the groups."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from rlflow.cli import cli_main

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
def test_each_shipped_config_loads_and_prints(config, capsys):
    with pytest.raises(SystemExit) as done:
        cli_main(["fit", "--config", str(config), "--print_config"])
    assert done.value.code in (0, None)
    printed = yaml.safe_load(capsys.readouterr().out)
    given = yaml.safe_load(config.read_text())
    for section in ("model", "data"):  # every value the file sets arrives where the file put it
        for key, value in given[section].items():
            if isinstance(value, dict) and key not in ("loss", "rollout", "judgers", "advantage"):
                for inner, v in value.items():
                    if not isinstance(v, dict):
                        assert printed[section][key][inner] == v, f"{section}.{key}.{inner}"
            elif not isinstance(value, dict):
                assert printed[section][key] == value, f"{section}.{key}"


def test_help_shows_the_settings_groups_with_their_docstrings(capsys):
    with pytest.raises(SystemExit):
        cli_main(["fit", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for group in ("data.sampling", "data.judging", "data.eval", "data.filtering", "data.pipeline",
                  "data.multiturn", "data.prompts", "model.optim", "model.update", "model.reference",
                  "model.rollout_correction", "model.policy"):
        assert f"--{group}." in text, group
    assert "--data.sampling.max_tokens MAX_TOKENS Most tokens generated per completion" in text
    assert "--data.max_tokens " not in text and "--model.lr " not in text
