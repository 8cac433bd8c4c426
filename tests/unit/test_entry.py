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
