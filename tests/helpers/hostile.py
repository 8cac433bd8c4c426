"""Hostile user code for the worker-process tests: judgers and tools that hang, exit, crash, leave processes behind
or return what cannot be pickled. Standard library only, so a worker process loads them in milliseconds.

A judger learns where to write its pid (and its grandchild's) from the ``pidfile`` column; a tool takes it as an
argument. Lines are ``<pid> <grandchild pid or ->``.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import threading
import time


def record_pid(pidfile: str, grandchild: int | None = None) -> None:
    with open(pidfile, "a") as f:
        f.write(f"{os.getpid()} {grandchild if grandchild is not None else '-'}\n")


def read_pids(pidfile) -> list[int]:
    """Every pid recorded in ``pidfile`` (workers and grandchildren)."""
    pids = []
    for line in open(pidfile).read().split("\n"):
        pids += [int(x) for x in line.split() if x != "-"]
    return pids


def gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (a zombie waiting to be reaped has ended too)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def all_gone(pids, within: float = 5.0) -> bool:
    """Whether every process of ``pids`` has ended, waiting up to ``within`` seconds."""
    deadline = time.monotonic() + within
    while not all(gone(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def threads_at_most(count: int, within: float = 2.0) -> bool:
    """Whether this process is down to ``count`` threads, waiting up to ``within`` seconds (a call's thread ends
    just after handing its result over)."""
    deadline = time.monotonic() + within
    while threading.active_count() > count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def hangs_on_request(completions, pidfile, **kwargs):
    """Sleeps forever when a completion says "hang"; else 1.0 each (and its pid recorded)."""
    record_pid(pidfile[0])
    if any("hang" in str(c) for c in completions):
        time.sleep(10_000)
    return [1.0] * len(completions)


def hangs_with_a_grandchild(completions, pidfile, **kwargs):
    """Starts ``sleep`` in a process of its own, then sleeps forever."""
    child = subprocess.Popen(["sleep", "600"])
    record_pid(pidfile[0], child.pid)
    time.sleep(10_000)


def exits(completions, **kwargs):
    sys.exit(3)


def exits_hard(completions, **kwargs):
    os._exit(7)


def interrupted(completions, **kwargs):
    raise KeyboardInterrupt


def segfaults(completions, **kwargs):
    ctypes.string_at(0)


def returns_a_lambda(completions, **kwargs):
    return [lambda: 1.0 for _ in completions]


class NeedsTwoArguments(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a} and {b}")


def raises_unpicklable(completions, **kwargs):
    raise NeedsTwoArguments("left", "right")


class ExitsWhenLoaded:
    """A judger whose unpickling, in its worker process, calls ``sys.exit``."""

    def __init__(self):
        self.armed = True  # some state, so that unpickling calls __setstate__

    def __call__(self, completions, **kwargs):
        return [1.0] * len(completions)

    def __setstate__(self, state):
        sys.exit(5)


def logs_in_the_trainer_state(completions, trainer_state, log_extra, log_metric, **kwargs):
    """Logs a column and a metric from ``trainer_state``; rewards the step."""
    log_extra("step_seen", [trainer_state.global_step] * len(completions))
    log_extra("text", [str(c)[:3] for c in completions])
    log_metric("steps_left", trainer_state.max_steps - trainer_state.global_step)
    return [float(trainer_state.global_step)] * len(completions)


def hangs_at_the_first_step(completions, trainer_state, **kwargs):
    """A TRL-style reward function that hangs at rollout step 0 (its pid recorded in ``$RLFLOW_TEST_PIDFILE``) and
    rewards short completions after."""
    record_pid(os.environ["RLFLOW_TEST_PIDFILE"])
    if trainer_state.global_step == 0:
        time.sleep(10_000)
    return [-len(c if isinstance(c, str) else c[-1]["content"]) / 10 for c in completions]


def logs_too_few(completions, log_extra, **kwargs):
    log_extra("short", [1])
    return [1.0] * len(completions)


def pid_reward(completions, **kwargs):
    """The pid of the process that ran it, as every reward."""
    return [float(os.getpid())] * len(completions)


class FailsOnOdd:
    """Fails per sample (odd positions give None), reported by ``consume_failed()``."""

    def __init__(self):
        self.failed = []

    def __call__(self, completions, **kwargs):
        self.failed = [i for i in range(len(completions)) if i % 2]
        return [None if i % 2 else 1.0 for i in range(len(completions))]

    def consume_failed(self):
        failed, self.failed = self.failed, []
        return failed


def takes_environments(completions, environments=None, **kwargs):
    """Rewards the pid of the process it ran in (environments live in the trainer)."""
    return [float(os.getpid())] * len(completions)


def thread_count_reward(completions, **kwargs):
    return [float(threading.active_count())] * len(completions)


# ------------------------------------------------------------------------------------------------ tools
def sleepy_tool(seconds: float, pidfile: str) -> str:
    """Sleeps, after starting ``sleep`` in a process of its own.

    Args:
        seconds: How long to sleep.
        pidfile: Where to record the pids.
    """
    child = subprocess.Popen(["sleep", "600"])
    record_pid(pidfile, child.pid)
    time.sleep(seconds)
    return "woke up"


def crashing_tool(code: int) -> str:
    """Ends its process with ``os._exit``.

    Args:
        code: The exit status.
    """
    os._exit(code)


def lambda_tool(x: int) -> str:
    """Returns a function, which cannot be pickled.

    Args:
        x: Ignored.
    """
    return lambda: x


def pid_tool(x: int) -> str:
    """The pid of the process that ran it.

    Args:
        x: Ignored.
    """
    return str(os.getpid())
