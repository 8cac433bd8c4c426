"""Worker processes for user code (judgers, tools) that a timeout can stop: :class:`Isolated`.

A thread that hangs cannot be stopped in Python; a process can. :class:`Isolated` runs one synchronous callable
in worker processes: each call goes to an idle worker (one is started where none is idle), its arguments and its
result (or exception) travel pickled, and a call that outlives its timeout has its worker killed, with the whole
process group, so the processes the callable started die too; the next call gets a fresh worker. A worker that
dies during a call (``os._exit``, a segfault, the kernel's OOM killer) fails that call with how it ended ("exited
with code 3", "was killed by signal SIGSEGV"), and one that cannot load the callable (an exception, ``sys.exit``
or a hang while unpickling it) fails the call with that reason; either way the next call starts a new one. A
``SystemExit`` or ``KeyboardInterrupt`` raised by the callable is an exception like any other: the worker serves on.

Where workers come from: a *zygote*, a Python process that has imported the rlflow modules the trainer has (and so
torch and transformers) once, forks each worker, which unpickles the callable: an importable function or class (a
TRL reward function named by import path, a plugin's judger) loads without re-importing the heavy modules, and a
worker replaced after a kill starts as fast. The zygote is spawned fresh (``python -c``), never forked from
the trainer, so no thread of the trainer (torch's OpenMP pool, event loops) is copied into a half-alive state,
and a worker may use CUDA. One zygote serves every :class:`Isolated` of a process; it is spawned on first use
(:func:`warm_up` starts it early, in the background). Only a callable that a fresh process can unpickle can run
there (:func:`portable`): not a closure, a lambda or a function of the script itself (``__main__``), which a new
process does not have. Callers run those in a thread of the trainer instead: a closure's state is the trainer's,
which a forked copy would change unseen, and a fork of the trainer (its threads' locks, torch's OpenMP pool, CUDA)
is no safe place to run code.

Nothing outlives the trainer: the zygote ends when its control socket to the trainer closes or when the trainer
dies (``PR_SET_PDEATHSIG``, on Linux), killing its workers' process groups first; a worker dies with its zygote
(``PR_SET_PDEATHSIG``). Each worker runs in the trainer's working directory, environment and ``sys.path`` of the
moment it was started. The zygote imports the trainer's own rlflow: its ``python -c`` first sets ``sys.path`` to
the folder holding this rlflow, then the trainer's ``sys.path`` without the working directory (``''``), so neither
a ``rlflow`` folder nor a module named like a standard one in the working directory takes their place; it preloads
from there, then takes the trainer's ``sys.path`` as it is (``''`` included) for its workers, whose user modules
import as they do in the trainer.

Keywords whose value is a :class:`Recorded` are callbacks (a judger's ``log_extra``, ``log_metric``): in the
worker they record their arguments, after checking them, and the caller replays the records on the real
callbacks (:attr:`Outcome.records`).

Only plain values travel back, since user code may write anything to its pipe. In the worker, a reply (the value,
the records) is made of plain values before it is pickled (:func:`_plain`: lists, tuples, dicts, sets, strings,
bytes, numbers, None; numpy and torch values through ``tolist()``, an iterator as a list); anything else fails the
call, naming its type. An exception travels as its class's module and name, its one-line message and, for Python's
own exceptions, its ``args`` (:func:`_sendable`); the trainer rebuilds Python's own as themselves and others as a
:class:`WorkerRaised` of the same name (:func:`_rebuilt`). The trainer reads whatever a worker or the zygote sends
with :func:`_load`, which builds plain values and nothing else (its ``find_class`` allows ``builtins.complex``,
``set`` and ``frozenset`` alone) and refuses values that refer to each other far more often than the bytes that
came allow: a reply holding anything else fails its call, naming what it held, and its worker is killed. No code
a worker chose runs in the trainer.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import ctypes
import io
import numbers
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

#: Seconds a new worker may take to load its callable (and the zygote, the first time, to start).
START_TIMEOUT = 60.0
#: Idle workers an :class:`Isolated` keeps for later calls; more, started for concurrent calls, end after theirs.
IDLE_WORKERS = 8
_PR_SET_PDEATHSIG = 1
_SHARED: _Zygote | None = None
_SHARED_LOCK = threading.Lock()
_LAUNCHER: concurrent.futures.ThreadPoolExecutor | None = None
_LAUNCHER_LOCK = threading.Lock()
#: The folder holding this rlflow: first on the zygote's ``sys.path``, so that it imports the trainer's rlflow.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The only globals a reply from a worker or the zygote may name (every other plain value has an opcode of its own).
_ALLOWED = frozenset({("builtins", "complex"), ("builtins", "set"), ("builtins", "frozenset")})


class WorkerError(Exception):
    """A worker process could not run the call: it died, could not load the callable, or could not send a
    result back."""


class WorkerCrashed(WorkerError):
    """The worker process died during the call, or could not load the callable (it raised, exited or hung)."""


class WorkerTimeout(TimeoutError):
    """The call outlived its timeout; its worker (and the worker's process group) was killed."""


class WorkerRaised(WorkerError):
    """An exception a call raised in its worker process, of a class the trainer does not load from a worker (only
    plain values travel): rebuilt as a subclass of this one with that class's name and module, and its message."""


class WorkerTraceback(Exception):
    """The traceback, in the worker process, of an exception a call raised there (its ``__cause__``)."""


class _Unreadable(Exception):
    """What a worker or the zygote sent cannot be read here (:func:`_load`); the message says why."""


@dataclass(frozen=True)
class Recorded:
    """A callback keyword: in the worker, a function that passes its arguments through ``check`` (which may raise,
    inside the callable, and returns the arguments to record) and records them for the caller to replay."""

    check: Callable[..., tuple[Any, ...]] | None = None


@dataclass
class Outcome:
    """How one call ended: its ``value``, or the ``error`` it raised or met (``killed`` when the timeout killed
    its worker); ``records``: the :class:`Recorded` callbacks' calls, ``(keyword, arguments)`` in order."""

    value: Any = None
    error: BaseException | None = None
    killed: bool = False
    records: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)
    pid: int | None = None


def how_it_ended(code: int | None) -> str:
    """``exited with code 3`` / ``was killed by signal SIGSEGV`` for a process's exit code (negative: a signal)."""
    if code is None:
        return "ended (its exit status is unknown)"
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by signal {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


class _NoMain(pickle.Pickler):
    """A pickler refusing what a fresh process could not unpickle: anything defined in ``__main__``."""

    def reducer_override(self, obj: Any) -> Any:
        try:
            module = getattr(obj, "__module__", None)
        except Exception:  # noqa: BLE001 - a hostile __getattr__: pickling decides
            module = None
        if module == "__main__":
            name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
            raise pickle.PicklingError(f"{name} is defined in __main__, which a new process does not have")
        return NotImplemented


def portable(fn: Any) -> tuple[bytes | None, str | None]:
    """``fn`` pickled for a fresh process (an :class:`Isolated`'s payload), or None and why it cannot be (it does
    not pickle, or pickles as a reference to ``__main__``)."""
    buffer = io.BytesIO()
    try:
        _NoMain(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(fn)
    except Exception as exc:  # noqa: BLE001 - any pickling failure: the caller runs it in a thread
        return None, f"{type(exc).__name__}: {exc}"
    return buffer.getvalue(), None


def _kill_group(pid: int) -> None:
    """SIGKILL the process group led by ``pid`` (a worker and what it started), or ``pid`` alone."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _die_with_parent(sig: int, parent: int) -> None:
    """Have the kernel send ``sig`` to this process when its parent thread ends (Linux); exit now if the parent
    ``parent`` is gone already."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(0)


def _launch(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in the launcher thread, which lives as long as the process: processes started there get their
    parent-death signal when the trainer ends, not when some short-lived thread does."""
    global _LAUNCHER
    with _LAUNCHER_LOCK:
        if _LAUNCHER is None:
            _LAUNCHER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rlflow-isolation")
        launcher = _LAUNCHER
    return launcher.submit(fn).result()


def preloaded() -> list[str]:
    """The modules the zygote imports up front: the rlflow modules the trainer has imported (rlflow's own, safe to
    import anywhere; with them torch and transformers), so that a worker imports only the user's module."""
    return sorted(name for name in list(sys.modules)
                  if (name == "rlflow" or name.startswith("rlflow.")) and not name.endswith("__main__"))


def _context() -> tuple[list[str], str, dict[str, str]]:
    return list(sys.path), os.getcwd(), dict(os.environ)


def _cut(text: str, limit: int = 200) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


# ------------------------------------------------------------------------------- reading what a worker sends
class _Reader(pickle.Unpickler):
    """An unpickler that builds plain values only: a global other than those of :data:`_ALLOWED` (the one way a
    pickle runs code: ``os._exit``, a class's ``__setstate__``) is refused, naming it."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return getattr(builtins, name)
        raise _Unreadable(f"it held a disallowed object {_cut(f'{module}.{name}')}")


def _load(data: bytes) -> Any:
    """What a worker or the zygote sent, as plain values (:class:`_Reader`) that refer to each other no more often
    than the size of ``data`` allows (:func:`_small`); else an :class:`_Unreadable` saying why. Runs no code the
    sender chose."""
    try:
        value = _Reader(io.BytesIO(data)).load()
    except _Unreadable:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the bytes make pickle raise
        raise _Unreadable(f"{type(exc).__name__}: {_cut(str(exc))}") from None
    if not _small(value, 2 * len(data) + 1024):
        raise _Unreadable("its values refer to each other far more often than its size allows (a structure built "
                          "to take the trainer's time or memory)")
    return value


def _small(value: Any, budget: int) -> bool:
    """Whether walking ``value`` (every container's items, each time the container is met) takes at most ``budget``
    steps. A reply made by :func:`_plain` holds each container once, so its walk is no longer than its pickle; one
    list referred to a million times over, or a list holding itself, is not."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            budget -= 2 * len(item)
            if budget < 0:
                return False
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            budget -= len(item)
            if budget < 0:
                return False
            stack.extend(item)
    return True


def _records(records: Any) -> list[tuple[str, tuple[Any, ...]]]:
    """A reply's :class:`Recorded` calls, checked to be ``(keyword, arguments)`` pairs (else a TypeError)."""
    if type(records) is not list or not all(type(r) is tuple and len(r) == 2 and type(r[0]) is str
                                            and type(r[1]) is tuple for r in records):
        raise TypeError("not a call's records")
    return records


def _text(value: Any) -> str:
    if type(value) is not str:
        raise TypeError("not a text")
    return value


# ----------------------------------------------------------------------------------------- the trainer's side
class _Zygote:
    """The trainer's handle on a zygote: a control socket to ask it for workers and for how they ended."""

    def __init__(self, sock: socket.socket, process: subprocess.Popen) -> None:
        self.sock = sock
        self.conn = Connection(os.dup(sock.fileno()))
        self.process = process
        self.lock = threading.Lock()
        self.closed = False

    @classmethod
    def spawn(cls) -> _Zygote:
        """A fresh Python process (the shared zygote) that imports :func:`preloaded`: this process's rlflow, as its
        ``-c`` code first sets ``sys.path`` to :data:`_ROOT` and this process's ``sys.path`` without ``''`` (which
        ``-c`` puts first: the working directory, whose ``rlflow`` folder or ``socket.py`` would be imported
        instead); it gets the whole ``sys.path`` once it has loaded (:func:`_zygote_main`)."""
        ours, theirs = socket.socketpair()
        path = [_ROOT, *(p for p in sys.path if p and p != _ROOT)]
        command = (f"import sys; sys.path[:] = {path!r}; from rlflow.isolation import _zygote_main; "
                   f"_zygote_main({theirs.fileno()}, {os.getpid()})")

        def start() -> subprocess.Popen:
            return subprocess.Popen([sys.executable, "-c", command], pass_fds=(theirs.fileno(),),
                                    stdin=subprocess.DEVNULL)

        try:
            process = _launch(start)
        finally:
            theirs.close()
        zygote = cls(ours, process)
        zygote.conn.send_bytes(pickle.dumps((list(sys.path), preloaded())))
        return zygote

    def alive(self) -> bool:
        return not self.closed and self.process.poll() is None

    def request(self, message: tuple[Any, ...], fd: int | None = None, timeout: float = START_TIMEOUT) -> Any:
        """Send ``message`` (and ``fd``) and return the answer; an OSError where the zygote is gone or silent."""
        with self.lock:
            self.conn.send_bytes(pickle.dumps(message))
            if fd is not None:
                socket.send_fds(self.sock, [b"F"], [fd])
            if not self.conn.poll(timeout):
                self.close()  # a late answer would be taken for the next request's
                raise OSError(f"the worker zygote did not answer within {timeout:g} s")
            try:
                return _load(self.conn.recv_bytes())
            except _Unreadable as exc:
                self.close()
                raise OSError(f"the worker zygote's answer cannot be read: {exc}") from None

    def fork_worker(self, payload: bytes) -> tuple[int, Connection]:
        """A new worker (its pid and the connection to it), loading the pickled callable ``payload``."""
        ours, theirs = socket.socketpair()
        try:
            _, pid = self.request(("fork", payload, _context()), theirs.fileno())
            if type(pid) is not int:
                raise OSError(f"the worker zygote answered {_cut(repr(pid))} for a process id")
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return pid, Connection(ours.detach())

    def exit_code(self, pid: int) -> int | None:
        """How worker ``pid`` ended, once the zygote has reaped it (None if unknown within a few seconds)."""
        try:
            code = self.request(("status", pid, 5.0), timeout=10.0)[1]
        except (OSError, EOFError, TypeError, LookupError):
            return None
        return code if type(code) is int else None

    def close(self) -> None:
        """End the zygote (it kills its workers first) by closing its control socket."""
        if self.closed:
            return
        self.closed = True
        for end in (self.conn, self.sock):
            try:
                end.close()
            except OSError:
                pass


def _shared_zygote(replace: _Zygote | None = None) -> _Zygote:
    """The process's shared zygote, spawned on first use (or when ``replace``, found dead, is the current one)."""
    global _SHARED
    with _SHARED_LOCK:
        if _SHARED is None or _SHARED is replace or not _SHARED.alive():
            if _SHARED is not None:
                _SHARED.close()
            _SHARED = _Zygote.spawn()
        return _SHARED


def warm_up() -> None:
    """Start the shared zygote in the background, so the first call does not wait for it."""
    if _SHARED is None:
        threading.Thread(target=_warm, name="rlflow-isolation-warm-up", daemon=True).start()


def _warm() -> None:
    try:
        _shared_zygote()
    except Exception:  # noqa: BLE001 - the first call starts it again and reports what fails
        pass


@dataclass
class _Worker:
    pid: int
    conn: Connection
    zygote: _Zygote

    def kill(self, force: bool = False) -> None:
        """SIGKILL the worker and its process group, unless it has ended already (its pid may be reused); ``force``:
        even where it has sent more than it was asked (which reads as having ended)."""
        try:
            ended = self.conn.poll(0)  # an EOF waits on the connection of a worker that has ended
        except OSError:
            ended = True
        if force or not ended:
            _kill_group(self.pid)
        self.conn.close()

    def idle_and_alive(self) -> bool:
        """Nothing to read from an idle worker: anything (an EOF) means it has ended."""
        try:
            return not self.conn.poll(0)
        except OSError:
            return False


@dataclass
class _Idle:
    """An :class:`Isolated`'s idle workers."""

    workers: list[_Worker] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        with self.lock:
            workers, self.workers = self.workers, []
        for worker in workers:
            worker.kill()


class Isolated:
    """Runs a callable in worker processes, each call bounded by a timeout that kills its worker (see the module).

    Args:
        payload: The callable, pickled by :func:`portable`.
        what: How messages name it (``"judger 'exact'"``).
        source: What the callable was made from, kept for the caller (to tell pools apart).
    """

    def __init__(self, payload: bytes, what: str, source: Any = None) -> None:
        self.payload = payload
        self.what = what
        self.source = source
        self._idle = _Idle()
        self._lock = self._idle.lock
        weakref.finalize(self, self._idle.close)  # garbage: its workers end too

    # --------------------------------------------------------------------------------------- workers
    def _start(self, timeout: float) -> _Worker:
        """A new worker that has loaded the callable; a :class:`WorkerError` saying why not."""
        zygote = _shared_zygote()
        try:
            pid, conn = zygote.fork_worker(self.payload)
        except (OSError, EOFError):  # the zygote died (e.g. killed from outside): one more, once
            zygote = _shared_zygote(replace=zygote)
            pid, conn = zygote.fork_worker(self.payload)
        worker = _Worker(pid, conn, zygote)
        if not conn.poll(timeout):
            worker.kill()
            raise WorkerCrashed(f"{self.what} did not load in its worker process within {timeout:g} s; the worker "
                                "was killed")
        try:
            answer = _load(conn.recv_bytes())
            if not (type(answer) is tuple and len(answer) == 2 and answer[0] in ("ready", "failed")
                    and type(answer[1]) is (int if answer[0] == "ready" else str)):
                raise _Unreadable("it is none of the answers a worker sends")
        except (EOFError, OSError):
            conn.close()
            raise WorkerCrashed(f"the worker process of {self.what} {how_it_ended(zygote.exit_code(pid))} while "
                                "loading it") from None
        except _Unreadable as exc:
            worker.kill(force=True)
            raise WorkerCrashed(f"{self.what} cannot be loaded in a worker process: its answer cannot be read here "
                                f"({exc}); the worker was killed") from None
        if answer[0] != "ready":
            conn.close()  # it ends by itself
            raise WorkerCrashed(f"{self.what} cannot be loaded in a worker process: {answer[1]}")
        return worker

    def acquire(self, timeout: float = START_TIMEOUT) -> _Worker:
        """An idle worker, or a new one (loading within ``timeout`` seconds; else a :class:`WorkerCrashed`)."""
        with self._lock:
            idle = self._idle.workers
            while idle:
                worker = idle.pop()
                if worker.idle_and_alive():
                    return worker
                worker.kill()
        try:
            return self._start(timeout)
        except (OSError, EOFError) as exc:  # the zygote cannot be reached, even a new one
            raise WorkerCrashed(f"no worker process for {self.what}: {type(exc).__name__}: {exc}") from exc

    def release(self, worker: _Worker) -> None:
        """Keep ``worker`` (from :meth:`acquire`, its call answered) for a later call, or end it."""
        with self._lock:
            if len(self._idle.workers) < IDLE_WORKERS:
                self._idle.workers.append(worker)
                return
        worker.kill()

    def prepare(self, timeout: float = START_TIMEOUT) -> WorkerError | None:
        """Have an idle worker ready (so a call's time is the call's); the error if none can start."""
        try:
            self.release(self.acquire(timeout))
        except WorkerError as exc:
            return exc
        return None

    def pids(self) -> list[int]:
        """The idle workers' process ids."""
        with self._lock:
            return [worker.pid for worker in self._idle.workers]

    # --------------------------------------------------------------------------------------- calls
    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float | None,
             start_timeout: float = START_TIMEOUT) -> Outcome:
        """``fn(*args, **kwargs)`` in a worker; the worker is killed at ``timeout`` seconds (None: no limit)."""
        try:
            worker = self.acquire(start_timeout)
        except WorkerError as exc:
            return Outcome(error=exc)
        return self.run(worker, args, kwargs, timeout)

    def run(self, worker: _Worker, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float | None) -> Outcome:
        """``fn(*args, **kwargs)`` on ``worker`` (from :meth:`acquire`), which it releases or kills."""
        try:
            request = pickle.dumps((args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - the arguments, not the worker, are at fault
            self.release(worker)
            return Outcome(error=WorkerError(f"the call's arguments cannot be sent to the worker process of "
                                             f"{self.what}: {type(exc).__name__}: {exc}"))
        try:
            worker.conn.send_bytes(request)
            ready = worker.conn.poll(timeout)
        except OSError:
            ready = True  # it died before or while reading the call: the read below tells how
        if not ready:
            worker.kill()
            return Outcome(error=WorkerTimeout(f"{self.what} did not return within {timeout:g} s; its worker "
                                               "process was killed"), killed=True, pid=worker.pid)
        try:
            reply = worker.conn.recv_bytes()
        except (EOFError, OSError):
            worker.conn.close()
            code = worker.zygote.exit_code(worker.pid)
            return Outcome(error=WorkerCrashed(f"the worker process of {self.what} {how_it_ended(code)} during the "
                                               "call; a new one serves the next call"), pid=worker.pid)
        try:
            outcome = _outcome(reply, self.what, worker.pid)
        except _Unreadable as exc:  # it sent what no worker of ours sends: not one to keep
            worker.kill(force=True)
            return Outcome(error=WorkerError(f"the reply of {self.what}'s worker process cannot be read here: {exc}; "
                                             "the worker was killed, a new one serves the next call"), pid=worker.pid)
        self.release(worker)
        return outcome

    def close(self) -> None:
        """Kill the idle workers (a busy one is kept after its call); a later call starts new ones."""
        self._idle.close()


def close_all(pools: dict[str, Isolated | None]) -> None:
    """Close every :class:`Isolated` of ``pools`` (a name -> pool mapping, None for no pool) and empty it."""
    for pool in list(pools.values()):
        if pool is not None:
            pool.close()
    pools.clear()


def _outcome(reply: bytes, what: str, pid: int) -> Outcome:
    """How a call ended, from its worker's ``reply`` (:func:`_serve`) read by :func:`_load`; an
    :class:`_Unreadable` where it cannot be read or is none of the replies a worker sends."""
    message = _load(reply)
    try:
        kind, *rest = message
        if kind == "ok":
            value, records = rest
            return Outcome(value=value, records=_records(records), pid=pid)
        if kind == "raised":
            description, text, records = rest
            error = _rebuilt(description)
            error.__cause__ = WorkerTraceback(f"in the worker process:\n{_text(text)}")
            return Outcome(error=error, records=_records(records), pid=pid)
        if kind == "unpicklable":
            text, records = rest
            return Outcome(error=WorkerError(f"{what} returned {_text(text)}"), records=_records(records), pid=pid)
    except (TypeError, ValueError):  # the wrong shape
        pass
    raise _Unreadable("it is none of the replies a worker sends")


_REBUILT: dict[tuple[str, str], type[WorkerRaised]] = {}


def _rebuilt(description: Any) -> BaseException:
    """The exception a worker described (:func:`_sendable`): Python's own (``builtins``) rebuilt from its arguments
    (or from its message, where those do not give it), a :class:`WorkerError` as one, any other as a
    :class:`WorkerRaised` subclass of the same name and module (one class per name, up to 256 kept). Nothing of the
    worker's is imported. A TypeError where ``description`` is not one a worker sends."""
    module, qualname, args, message = description
    if not (type(module) is str and type(qualname) is str and type(message) is str
            and (args is None or type(args) is tuple)):
        raise TypeError("not an exception's description")
    if module == "builtins":
        cls = getattr(builtins, qualname, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            try:
                error = cls(*args) if args is not None else cls(message)
                return error if str(error) == message else cls(message)
            except Exception:  # noqa: BLE001 - one wanting other arguments (UnicodeDecodeError): by its name below
                pass
    if (module, qualname) == (__name__, "WorkerError"):
        return WorkerError(message)
    module, qualname = _cut(module), _cut(qualname)
    cls = _REBUILT.get((module, qualname))
    if cls is None:
        try:
            cls = type(qualname.rpartition(".")[2], (WorkerRaised,), {"__module__": module, "__qualname__": qualname})
        except Exception:  # noqa: BLE001 - a name type() refuses (a NUL character)
            cls = WorkerRaised
        if len(_REBUILT) < 256:
            _REBUILT[(module, qualname)] = cls
    return cls(message)


# ----------------------------------------------------------------------------------------- the processes' side
def _zygote_main(fd: int, trainer: int) -> None:
    """Entry point of the spawned zygote: read the trainer's ``sys.path`` and the modules to preload; preload them
    (from the path :meth:`_Zygote.spawn` set), take that ``sys.path``, then serve."""
    sock = socket.socket(fileno=fd)
    try:
        conn = Connection(os.dup(fd))
        path, preload = pickle.loads(conn.recv_bytes())
        conn.close()
        for module in preload:  # from the path spawn() set: the trainer's rlflow, not the working directory's
            try:
                __import__(module)
            except BaseException:  # noqa: BLE001 - preloading only saves time; the worker imports it or says why
                pass
        sys.path[:] = path
        _zygote_loop(sock, trainer)
    finally:
        os._exit(0)


class _ZygoteState:
    """The zygote's workers and the exit codes of those that ended (filled by the SIGCHLD handler)."""

    def __init__(self) -> None:
        self.workers: set[int] = set()
        self.ended: dict[int, int] = {}

    def reap(self, *_: Any) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.workers.discard(pid)
            self.ended[pid] = os.waitstatus_to_exitcode(status)
            while len(self.ended) > 256:  # workers killed at their timeout: nobody asks how they ended
                del self.ended[next(iter(self.ended))]

    def stop(self, *_: Any) -> None:
        """Kill every worker's process group and end."""
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for pid in list(self.workers):
            _kill_group(pid)
        os._exit(0)


def _zygote_loop(sock: socket.socket, trainer: int) -> None:
    """Fork a worker per request; end with the control socket."""
    state = _ZygoteState()
    try:
        os.setpgid(0, 0)  # a terminal's Ctrl-C goes to the trainer, which stops its run; not to us
    except OSError:
        pass
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, state.stop)
    signal.signal(signal.SIGCHLD, state.reap)
    _die_with_parent(signal.SIGTERM, trainer)
    conn = Connection(os.dup(sock.fileno()))
    zygote = os.getpid()
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            state.stop()
        if message[0] == "status":
            _, pid, wait = message
            deadline = time.monotonic() + wait
            while pid not in state.ended and pid in state.workers and time.monotonic() < deadline:
                time.sleep(0.01)  # the SIGCHLD handler reaps it
            conn.send_bytes(pickle.dumps(("status", state.ended.pop(pid, None))))
            continue
        _, payload, context = message
        _, fds, _, _ = socket.recv_fds(sock, 1, 1)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # reaped only once it is in state.workers
        pid = os.fork()
        if pid == 0:
            try:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
                for end in (conn, sock):
                    end.close()
                _worker_main(fds[0], payload, context, zygote)
            finally:
                os._exit(0)
        os.close(fds[0])
        state.workers.add(pid)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass
        conn.send_bytes(pickle.dumps(("forked", pid)))


def _worker_main(fd: int, payload: bytes, context: tuple[list[str], str, dict[str, str]], zygote: int) -> None:
    """A worker: its own process group, dies with its zygote; load the callable, then serve calls."""
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    for sig in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _die_with_parent(signal.SIGKILL, zygote)
    conn = Connection(fd)
    path, cwd, environ = context
    try:
        sys.path[:] = path
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(environ)
        fn = pickle.loads(payload)
    except BaseException as exc:  # noqa: BLE001 - SystemExit while importing its module too
        conn.send_bytes(pickle.dumps(("failed", _one_line(exc))))
        return
    conn.send_bytes(pickle.dumps(("ready", os.getpid())))
    _serve(conn, fn)


def _type_name(obj: Any) -> str:
    """``type(obj).__name__``, read past any metaclass (whose ``__name__`` may raise); never raises."""
    try:
        name = type.__dict__["__name__"].__get__(type(obj))
    except BaseException:  # noqa: BLE001 - nothing is known of it
        return "object"
    return name if type(name) is str else "object"


def _class_of(obj: Any) -> tuple[str, str]:
    """The module and qualified name of ``obj``'s class (``"?"`` for one that cannot be read); never raises."""
    names = []
    for attribute in ("__module__", "__qualname__"):
        try:
            name = type.__dict__[attribute].__get__(type(obj))
        except BaseException:  # noqa: BLE001 - a class whose __module__ is a property of its metaclass
            name = None
        names.append(name if type(name) is str else "?")
    return names[0], names[1]


def _message(exc: BaseException) -> tuple[str, bool]:
    """``str(exc)`` as a plain str and True; where its ``__str__`` raises (anything, ``SystemExit`` too), ``(its
    message could not be read: ErrorType)`` and False. Never raises."""
    try:
        return str.__str__(str(exc)), True
    except BaseException as error:  # noqa: BLE001 - a hostile __str__
        return f"(its message could not be read: {_type_name(error)})", False


def _one_line(exc: BaseException) -> str:
    """``Type: message`` of ``exc`` on one line (``Type (its message could not be read: ErrorType)`` where its
    ``str()`` raises); never raises."""
    text, readable = _message(exc)
    text = " ".join(text.split())
    return f"{_type_name(exc)}{': ' if readable else ' '}{text}" if text else _type_name(exc)


def _recorder(key: str, check: Callable[..., tuple[Any, ...]] | None,
              records: list[tuple[str, tuple[Any, ...]]]) -> Callable[..., None]:
    def record(*args: Any) -> None:
        records.append((key, tuple(check(*args)) if check is not None else args))

    return record


def _serve(conn: Connection, fn: Any) -> None:
    """Answer calls until the trainer closes the connection: each reply is ``("ok", value, records)``,
    ``("raised", description, traceback, records)`` (:func:`_sendable`) or ``("unpicklable", message, records)``,
    of plain values only (:func:`_dumped`)."""
    while True:
        try:
            args, kwargs = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        records: list[tuple[str, tuple[Any, ...]]] = []
        for key, value in list(kwargs.items()):
            if isinstance(value, Recorded):
                kwargs[key] = _recorder(key, value.check, records)
        try:
            value = fn(*args, **kwargs)
            if hasattr(value, "__await__"):  # a plain callable handing back a coroutine
                import asyncio

                value = asyncio.run(_awaited(value))
            reply = ("ok", value, records)
        except BaseException as exc:  # noqa: BLE001 - SystemExit and KeyboardInterrupt are the call's failure
            reply = ("raised", _sendable(exc), _traceback_text(), records)
        conn.send_bytes(_dumped(reply))
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed or replaced stream
                pass


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _traceback_text() -> str:
    """The traceback of the exception being handled; never raises."""
    try:
        return str.__str__(traceback.format_exc())
    except BaseException:  # noqa: BLE001 - a hostile exception's parts
        return "(its traceback could not be formatted)"


def _sendable(exc: BaseException) -> tuple[str, str, tuple[Any, ...] | None, str]:
    """What of ``exc`` travels back, for :func:`_rebuilt`: its class's module and qualified name, the arguments
    that rebuild it (Python's own exceptions only, from their ``__reduce__``, where those are plain values; else
    None) and its message. One that does not survive pickling both ways (an ``__init__`` taking other arguments, a
    ``__reduce__`` that raises) travels as a :class:`WorkerError` saying so, with its type and message. Never
    raises: a message that cannot be read is said to be so (:func:`_one_line`)."""
    try:
        pickle.loads(pickle.dumps(exc))
    except BaseException:  # noqa: BLE001 - whatever its pickling raises
        why = f"{_one_line(exc)} (its exception could not be sent back from the worker process)"
        return __name__, "WorkerError", None, why
    module, qualname = _class_of(exc)
    args = None
    if module == "builtins" and type(exc) is getattr(builtins, qualname, None):
        try:
            args = _plain(tuple(exc.__reduce__()[1]))  # an OSError's filename too
        except BaseException:  # noqa: BLE001 - args that are not plain values: rebuilt from the message
            args = None
    return module, qualname, args, _message(exc)[0]


_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def _plain(value: Any) -> Any:
    """``value`` as the plain values :func:`_load` reads: containers copied as lists, tuples, dicts, sets and
    frozensets (a subclass, a namedtuple, as its base), numpy arrays and scalars and torch tensors through
    ``tolist()``, other numbers as int, float or complex, a str subclass as a str, bytes-like values as bytes, an
    iterator (a generator) as a list; anything else raises a TypeError naming its class. Runs in the worker, on
    user code's values: it raises whatever they raise."""
    if type(value) in _SCALARS:
        return value
    if isinstance(value, dict):
        return {_plain(key): _plain(item) for key, item in value.items()}
    for base in (list, tuple, set, frozenset):
        if isinstance(value, base):
            return base([_plain(item) for item in value])
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(memoryview(value))
    tolist = getattr(value, "tolist", None)
    if callable(tolist):  # numpy, torch
        return _plain(tolist())
    for kind, make in ((numbers.Integral, int), (numbers.Real, float), (numbers.Complex, complex)):
        if isinstance(value, kind):
            return make(value)
    if hasattr(value, "__next__"):
        return [_plain(item) for item in value]
    module, qualname = _class_of(value)
    raise TypeError(f"a {module}.{qualname} is not a plain value (lists, tuples, dicts, sets, strings, bytes, "
                    "numbers and None travel back from a worker process)")


def _shown(value: Any) -> str:
    """``repr(value)``, cut to 200 characters; never raises."""
    try:
        shown = str.__str__(repr(value))
    except BaseException:  # noqa: BLE001 - a hostile __repr__
        shown = f"<{_type_name(value)}>"
    return shown if len(shown) <= 200 else shown[:200] + "..."


def _dumped(reply: tuple[Any, ...]) -> bytes:
    """``reply`` made :func:`_plain` and pickled. A value (or records) that is not plain, or that raises while
    converted, fails the call instead (``unpicklable``, with its type and repr); an exception's reply whose records
    fail travels without them. Never raises."""
    try:
        return pickle.dumps(_plain(reply), protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as exc:  # noqa: BLE001 - user objects may raise anything (SystemExit too) while converted
        failure = _one_line(exc)
    try:
        records = _plain(reply[-1])
    except BaseException as exc:  # noqa: BLE001 - the records failed (too)
        if reply[0] == "raised":  # its description is plain: it travels without them
            return _dumped((*reply[:-1], []))
        records, failure = [], _one_line(exc)
        message = (f"a value, but what it logged cannot be sent back from its worker process ({failure}): "
                   f"{_shown(reply[-1])}")
    else:
        message = (f"a {_type_name(reply[1])} that cannot be sent back from its worker process ({failure}): "
                   f"{_shown(reply[1])}")
    return pickle.dumps(("unpicklable", message, records), protocol=pickle.HIGHEST_PROTOCOL)
