"""rlflow/requirements.py: installed dependencies outside rlflow's declared ranges are named at startup, in one line."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest

import rlflow.entry as entry
from rlflow import requirements

DECLARED = [
    "torch>=2.10",
    "jsonargparse[signatures]>=4.45",
    "transformers>=5.4",
    "wandb>=0.17",
    'peft>=0.13; extra == "lora"',
    'pywin32>=300; sys_platform == "win32"',
]


def fake_environment(monkeypatch, installed: dict[str, str]) -> None:
    """rlflow's metadata declares :data:`DECLARED`; ``installed`` are the versions found (others: not installed)."""

    def requires(name):
        if name != "rlflow":
            raise metadata.PackageNotFoundError(name)
        return DECLARED

    def version(name):
        if name not in installed:
            raise metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(requirements.metadata, "requires", requires)
    monkeypatch.setattr(requirements.metadata, "version", version)


def test_below_a_floor_and_missing_are_named_extras_and_other_platforms_are_not(monkeypatch):
    fake_environment(monkeypatch, {"torch": "2.6.0+cu124", "transformers": "5.4.0", "wandb": "0.17.0",
                                   "peft": "0.1.0"})
    problems = requirements.unmet()
    assert problems == [requirements.Unmet("torch", "2.6.0+cu124", "torch>=2.10"),
                        requirements.Unmet("jsonargparse", None, "jsonargparse[signatures]>=4.45")]
    assert str(problems[0]) == "torch 2.6.0+cu124 (rlflow needs torch>=2.10)"
    assert str(problems[1]) == "jsonargparse not installed (rlflow needs jsonargparse[signatures]>=4.45)"


def test_a_missing_dependency_that_only_some_runs_import_is_not_a_problem_but_its_version_is(monkeypatch):
    fake_environment(monkeypatch, {"torch": "2.10.0", "jsonargparse": "4.45.0", "transformers": "5.4.0"})
    assert requirements.unmet() == []  # wandb: imported by the wandb logger alone, which names it when missing
    fake_environment(monkeypatch, {"torch": "2.10.0", "jsonargparse": "4.45.0", "transformers": "5.4.0",
                                   "wandb": "0.16.0"})
    assert requirements.unmet() == [requirements.Unmet("wandb", "0.16.0", "wandb>=0.17")]
    assert requirements.IMPORTED_WHEN_USED == {"wandb", "ninja"}


def test_versions_at_or_above_the_floors_pass_prereleases_and_local_builds_included(monkeypatch):
    fake_environment(monkeypatch, {"torch": "2.11.0.dev20260101+cpu", "jsonargparse": "4.45.0",
                                   "transformers": "5.30.0rc1", "wandb": "0.31.0"})
    assert requirements.unmet() == []


def test_an_unreadable_version_is_let_through_and_no_metadata_means_no_check(monkeypatch):
    fake_environment(monkeypatch, {"torch": "custom-build", "jsonargparse": "4.45.0", "transformers": "5.4.0",
                                   "wandb": "0.17.0"})
    assert requirements.unmet() == []
    assert requirements.unmet("a-distribution-that-is-not-installed") == []


def test_the_line_names_each_problem_and_the_pip_command_that_fixes_it():
    line = requirements.message([requirements.Unmet("torch", "2.6.0", "torch>=2.10"),
                                 requirements.Unmet("jsonargparse", None, "jsonargparse[signatures]>=4.45")])
    assert "\n" not in line
    assert line == ("rlflow: error: torch 2.6.0 (rlflow needs torch>=2.10); jsonargparse not installed (rlflow needs "
                    "jsonargparse[signatures]>=4.45). Install the versions rlflow needs: pip install -U "
                    "'torch>=2.10' 'jsonargparse[signatures]>=4.45'")


def test_this_environment_meets_rlflows_own_declared_ranges():
    declared = metadata.requires("rlflow")
    assert any(line.startswith("torch") for line in declared)  # the installed metadata is rlflow's
    assert requirements.unmet() == []


@pytest.mark.parametrize("command", [["plugins"], ["data", "check", "--config", "configs/demo_cpu.yaml"],
                                     ["fit", "--config", "configs/demo_cpu.yaml"], ["export", "--help"]])
def test_every_command_stops_at_startup_with_the_one_line(monkeypatch, capsys, command):
    fake_environment(monkeypatch, {"torch": "2.6.0", "jsonargparse": "4.45.0", "transformers": "5.4.0",
                                   "wandb": "0.17.0"})
    called = []
    monkeypatch.setattr("rlflow.plugins_cmd.main", lambda *a: called.append(a) or 0)
    assert entry.main(command) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("rlflow: error: torch 2.6.0 (rlflow needs torch>=2.10). Install the versions rlflow needs: "
                   "pip install -U 'torch>=2.10'")
    assert called == []


def test_help_needs_no_check_and_a_met_environment_runs_the_command(monkeypatch, capsys):
    fake_environment(monkeypatch, {"torch": "2.6.0"})
    assert entry.main(["--help"]) == 0
    assert "usage: rlflow" in capsys.readouterr().out
    monkeypatch.undo()
    ran = subprocess.run([sys.executable, "-m", "rlflow", "plugins"], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert "rlflow: error" not in ran.stderr
    assert "gsm8k" in ran.stdout


def test_rlflow_ignore_requirements_turns_the_stop_into_a_warning_and_runs_the_command(monkeypatch, capsys):
    fake_environment(monkeypatch, {"torch": "2.6.0", "jsonargparse": "4.45.0", "transformers": "5.4.0"})
    monkeypatch.setattr("rlflow.plugins_cmd.main", lambda *a: 7)
    monkeypatch.setenv("RLFLOW_IGNORE_REQUIREMENTS", "1")
    assert entry.main(["plugins"]) == 7
    assert capsys.readouterr().err.strip() == (
        "rlflow: warning (RLFLOW_IGNORE_REQUIREMENTS=1): torch 2.6.0 (rlflow needs torch>=2.10). Install the "
        "versions rlflow needs: pip install -U 'torch>=2.10'")
