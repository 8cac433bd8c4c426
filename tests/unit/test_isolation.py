"""rlflow.isolation's promise that nothing outlives the trainer: after SIGKILL or SIGTERM of the process that started
them, its worker processes, what they started and their zygote are gone. Plus how an exit is told, and what a new
process cannot load."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from rlflow.isolation import how_it_ended, portable
from tests.helpers import hostile
from tests.helpers.paths import ROOT

TRAINER = """
import sys
from rlflow.isolation import Isolated, portable
from tests.helpers import hostile

payload, _ = portable(hostile.hangs_with_a_grandchild)
Isolated(payload, "judger").call((), {"completions": ["a"], "pidfile": [sys.argv[1]]}, None)
"""
IN_MAIN = """
from rlflow.isolation import portable

def reward(completions):
    return [1.0]

print(portable(reward)[1])
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_workers_what_they_started_and_their_zygote_end_with_the_trainer(tmp_path, sig):
    pidfile = tmp_path / "pids"
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(pidfile)], cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        deadline = time.monotonic() + 60
        while not (pidfile.exists() and pidfile.read_text().endswith("\n")):
            assert trainer.poll() is None and time.monotonic() < deadline, "the worker never started"
            time.sleep(0.05)
        zygotes = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(trainer.pid)], capture_output=True,
                                                       text=True).stdout.split()]
        worker, grandchild = hostile.read_pids(pidfile)
        assert zygotes and not hostile.gone(worker) and not hostile.gone(grandchild)
    finally:
        trainer.send_signal(sig)
        trainer.wait()
    assert hostile.all_gone([*zygotes, worker, grandchild])


def test_how_an_exit_is_told_and_what_cannot_be_sent():
    assert how_it_ended(3) == "exited with code 3"
    assert how_it_ended(-signal.SIGSEGV) == "was killed by signal SIGSEGV"
    assert how_it_ended(None) == "ended (its exit status is unknown)"
    payload, why = portable(hostile.pid_reward)
    assert payload and why is None
    payload, why = portable(lambda: 1)
    assert payload is None and "Can't pickle" in why
    main = subprocess.run([sys.executable, "-c", IN_MAIN], capture_output=True, text=True, check=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert main.stdout.strip() == "PicklingError: reward is defined in __main__, which a new process does not have"
