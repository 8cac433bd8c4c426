"""rlflow/entry.py: the console script returns the command's exit code and freezes what is alive before exiting."""

from __future__ import annotations

import gc

import pytest

import rlflow.entry as entry


@pytest.mark.parametrize("raised", [False, True])
def test_the_script_freezes_the_heap_after_the_command_whatever_it_returns_or_raises(monkeypatch, raised):
    calls = []

    def command() -> int:
        calls.append("main")
        if raised:
            raise KeyboardInterrupt
        return 3

    monkeypatch.setattr(entry, "main", command)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))  # the test process itself goes on
    if raised:
        with pytest.raises(KeyboardInterrupt):
            entry.script()
    else:
        assert entry.script() == 3
    assert calls == ["main", "freeze"]


def test_help_lists_every_command_that_main_dispatches(capsys):
    assert entry.main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = [line.split()[0] for line in out.splitlines() if line.startswith("  ") and not line.startswith("   ")]
    assert listed == ["fit", "validate", "data", "plugins", "export", "config"]
    assert "Lightning Trainer" not in out


def test_no_command_prints_the_commands_and_exits_2(capsys):
    assert entry.main([]) == 2
    assert "commands:" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["test", "predict", "fti"])
def test_a_command_rlflow_does_not_run_is_one_line_naming_the_commands(capsys, command):
    assert entry.main([command, "--config", "configs/demo_cpu.yaml"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert f"{command!r} is not a command" in err and "fit, validate" in err

