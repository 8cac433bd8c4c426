"""rlflow.isolation against user code that lies: a worker's reply is read as plain values only, so what it writes to
its pipe runs no code in the trainer (its worker is killed instead); an exception that can be neither sent nor
printed is still told by its type; and the zygote imports the trainer's rlflow, not a ``rlflow`` folder of the
working directory, while the user's modules there import in workers as in the trainer."""

from __future__ import annotations

import importlib
import json
import math
import os
import pickle
import subprocess
import sys
import types
from collections import OrderedDict
from multiprocessing.connection import Connection

import pytest

from rlflow import isolation
from rlflow.isolation import Isolated, Recorded, WorkerCrashed, WorkerError, portable
from tests.helpers.paths import ROOT


class Evil:
    """Unpickling it ends the process that unpickles it, with exit code 7."""

    def __reduce__(self):
        return os._exit, (7,)


class Calls:
    """Unpickling it calls ``os.getpid``: harmless, but code the sender chose."""

    def __reduce__(self):
        return os.getpid, ()


def _lie() -> None:
    """From now on, whatever this process sends on a connection is a pickled :class:`Evil`."""
    evil = pickle.dumps(Evil())
    Connection.send_bytes = lambda self, *args, **kwargs: Connection._send_bytes(self, memoryview(evil))


def lies_on_request(completions, **kwargs):
    """Its worker's reply (this one and every later one) is an :class:`Evil` when asked to "lie"; else its pid."""
    if completions == ["lie"]:
        _lie()
    return [float(os.getpid())] * len(completions)


class LiesWhenLoaded:
    """A judger whose worker, once it has unpickled it, answers "ready" with an :class:`Evil`."""

    def __init__(self):
        self.armed = True

    def __call__(self, completions, **kwargs):
        return [1.0] * len(completions)

    def __setstate__(self, state):
        self.__dict__.update(state)
        _lie()


TRAINER = """
import json
from rlflow.isolation import Isolated, portable
from tests.helpers import hostile
from tests.unit.test_isolation_hostile import LiesWhenLoaded, lies_on_request

pool = Isolated(portable(lies_on_request)[0], "judger 'lies_on_request'")
lied = pool.call((), {"completions": ["lie"]}, 20)
honest = pool.call((), {"completions": ["ok"]}, 20)
loading = Isolated(portable(LiesWhenLoaded())[0], "judger 'LiesWhenLoaded'").call((), {"completions": ["a"]}, 20)
print(json.dumps({"lied": [type(lied.error).__name__, str(lied.error), lied.pid, hostile.all_gone([lied.pid])],
                  "honest": [honest.error is None, honest.value, honest.pid],
                  "loading": [type(loading.error).__name__, str(loading.error)]}))
"""


def test_a_reply_that_would_run_code_in_the_trainer_fails_its_call_and_its_worker_is_replaced():
    # in a trainer of its own: before rlflow read replies as plain values, this one ended with exit code 7
    trainer = subprocess.run([sys.executable, "-c", TRAINER], capture_output=True, text=True, cwd=ROOT, timeout=60,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert trainer.returncode == 0, trainer.stderr
    told = json.loads(trainer.stdout.strip().splitlines()[-1])
    kind, message, liar, gone = told["lied"]
    assert kind == "WorkerError" and message.startswith(
        "the reply of judger 'lies_on_request''s worker process cannot be read here: it held a disallowed object "
        "posix._exit; the worker was killed")
    assert gone  # killed, not kept for the next call
    fine, value, pid = told["honest"]
    assert fine and value == [float(pid)] and pid != liar
    assert told["loading"] == ["WorkerCrashed", "judger 'LiesWhenLoaded' cannot be loaded in a worker process: its "
                               "answer cannot be read here (it held a disallowed object posix._exit); the worker "
                               "was killed"]


def test_what_a_worker_sends_is_read_as_plain_values_only():
    for protocol in (3, pickle.HIGHEST_PROTOCOL):
        plain = {"n": [1, 2.5, None, True], "c": 1 + 2j, "s": {1, 2}, "f": frozenset({3}), "t": ("a", b"b")}
        assert isolation._load(pickle.dumps(plain, protocol)) == plain
    assert math.isnan(isolation._load(pickle.dumps([float("nan")]))[0])
    for sent, named in [(Calls(), "posix.getpid"), (OrderedDict(), "collections.OrderedDict"),
                        (types.SimpleNamespace(), "types.SimpleNamespace")]:
        with pytest.raises(isolation._Unreadable, match=f"^it held a disallowed object {named}$"):
            isolation._load(pickle.dumps(sent))
    row = [None] * 1000
    itself: list = []
    itself.append(itself)
    for structure in ([row] * 1000, itself):  # a million values from a few kilobytes; a list that holds itself
        with pytest.raises(isolation._Unreadable, match="refer to each other far more often than its size allows"):
            isolation._load(pickle.dumps(structure))


def returns_numpy_and_friends(completions, log_extra, **kwargs):
    import numpy as np

    log_extra("scores", {"a": np.int64(1), "b": [np.float32(0.5)], "c": np.array([[1, 2]])})
    return {"array": np.arange(3, dtype=np.float32), "scalar": np.float64(0.25), "none": None, "nan": float("nan"),
            "generator": (i for i in range(2)), "complex": 1 + 2j, "set": {1}, "bytes": bytearray(b"x"),
            "pair": os.terminal_size((3, 4)), "text": np.str_("t")}


def test_numpy_values_none_nan_and_records_come_back_as_plain_values():
    outcome = Isolated(portable(returns_numpy_and_friends)[0], "judger 'numpy'").call(
        (), {"completions": ["a"], "log_extra": Recorded()}, 20)
    assert outcome.error is None, outcome.error
    value = outcome.value
    assert math.isnan(value.pop("nan"))
    assert value == {"array": [0.0, 1.0, 2.0], "scalar": 0.25, "none": None, "generator": [0, 1], "complex": 1 + 2j,
                     "set": {1}, "bytes": b"x", "pair": (3, 4), "text": "t"}
    assert type(value["scalar"]) is float and type(value["array"][0]) is float and type(value["pair"]) is tuple
    assert outcome.records == [("log_extra", ("scores", {"a": 1, "b": [0.5], "c": [[1, 2]]}))]


class BadExc(Exception):
    """Can be neither pickled nor printed."""

    def __reduce__(self):
        raise TypeError("not this one")

    def __str__(self):
        raise RuntimeError("nor this")


def raises(completions, **kwargs):
    """Raises what its one completion names."""
    what = completions[0]
    if what == "bad":
        raise BadExc()
    if what == "exit":
        raise SystemExit(3)
    if what == "os":
        raise OSError(2, "gone", "file")
    module = sys.modules.setdefault("only_in_the_worker", types.ModuleType("only_in_the_worker"))
    module.OnlyHere = type("OnlyHere", (Exception,), {"__module__": "only_in_the_worker"})
    raise module.OnlyHere("boom")


def test_an_exception_is_told_by_its_type_and_message_even_where_neither_can_be_sent_nor_read():
    pool = Isolated(portable(raises)[0], "judger 'raises'")
    bad = pool.call((), {"completions": ["bad"]}, 20)
    assert type(bad.error) is WorkerError and not isinstance(bad.error, WorkerCrashed)  # not "exited with code 0"
    assert str(bad.error) == ("BadExc (its message could not be read: RuntimeError) (its exception could not be sent "
                              "back from the worker process)")
    again = pool.call((), {"completions": ["bad"]}, 20)
    assert str(again.error) == str(bad.error) and again.pid == bad.pid  # the worker serves on
    exit_, os_error, other = (pool.call((), {"completions": [what]}, 20).error for what in ("exit", "os", "other"))
    assert type(exit_) is SystemExit and exit_.code == 3  # Python's own exceptions are rebuilt as themselves
    assert type(os_error) is FileNotFoundError and str(os_error) == "[Errno 2] gone: 'file'"
    assert isinstance(other, isolation.WorkerRaised) and type(other).__name__ == "OnlyHere" and str(other) == "boom"
    assert type(other).__module__ == "only_in_the_worker" and "only_in_the_worker" not in sys.modules
    assert "raise module.OnlyHere" in str(other.__cause__)  # the worker's traceback


JUDGER = """import os


def judger(completions, **kwargs):
    import rlflow

    return {"rlflow": rlflow.__file__, "judger": os.path.abspath(__file__), "cwd": os.getcwd()}
"""


def test_the_zygote_imports_the_trainers_rlflow_and_workers_the_users_modules_of_the_working_directory(
        tmp_path, monkeypatch):
    (tmp_path / "rlflow").mkdir()
    (tmp_path / "rlflow" / "__init__.py").write_text("raise ImportError('the rlflow of the working directory')\n")
    (tmp_path / "socket.py").write_text("raise ImportError('the socket of the working directory')\n")
    (tmp_path / "judger_of_the_working_directory.py").write_text(JUDGER)  # a user's judger module
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", ["", *sys.path])  # as `python -c` or a notebook has it
    monkeypatch.setattr(isolation, "_SHARED", None)  # a zygote of its own, spawned from this working directory
    monkeypatch.setattr(isolation, "preloaded", lambda: ["rlflow.isolation"])  # started in a blink
    importlib.invalidate_caches()
    try:
        judger = importlib.import_module("judger_of_the_working_directory").judger
        outcome = Isolated(portable(judger)[0], "judger 'judger'").call((), {"completions": ["a"]}, 20)
    finally:
        sys.modules.pop("judger_of_the_working_directory", None)
        if isolation._SHARED is not None:
            isolation._SHARED.close()
    assert outcome.error is None, outcome.error
    assert outcome.value == {"rlflow": sys.modules["rlflow"].__file__, "cwd": str(tmp_path),
                             "judger": str(tmp_path / "judger_of_the_working_directory.py")}
