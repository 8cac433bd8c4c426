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
moment it was started.

Keywords whose value is a :class:`Recorded` are callbacks (a judger's ``log_extra``, ``log_metric``): in the
worker they record their arguments, after checking them, and the caller replays the records on the real
callbacks (:attr:`Outcome.records`).
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import io
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


class WorkerError(Exception):
    """A worker process could not run the call: it died, could not load the callable, or could not send a
    result back."""


class WorkerCrashed(WorkerError):
    """The worker process died during the call, or could not load the callable (it raised, exited or hung)."""


class WorkerTimeout(TimeoutError):
    """The call outlived its timeout; its worker (and the worker's process group) was killed."""


class WorkerTraceback(Exception):
    """The traceback, in the worker process, of an exception a call raised there (its ``__cause__``)."""


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
        """A fresh Python process (the shared zygote) that imports :func:`preloaded`."""
        ours, theirs = socket.socketpair()
        command = f"from rlflow.isolation import _zygote_main; _zygote_main({theirs.fileno()}, {os.getpid()})"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}

        def start() -> subprocess.Popen:
            return subprocess.Popen([sys.executable, "-c", command], pass_fds=(theirs.fileno(),), env=env,
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
            return pickle.loads(self.conn.recv_bytes())

    def fork_worker(self, payload: bytes) -> tuple[int, Connection]:
        """A new worker (its pid and the connection to it), loading the pickled callable ``payload``."""
        ours, theirs = socket.socketpair()
        try:
            _, pid = self.request(("fork", payload, _context()), theirs.fileno())
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return pid, Connection(ours.detach())

    def exit_code(self, pid: int) -> int | None:
        """How worker ``pid`` ended, once the zygote has reaped it (None if unknown within a few seconds)."""
        try:
            return self.request(("status", pid, 5.0), timeout=10.0)[1]
        except (OSError, EOFError):
            return None

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

    def kill(self) -> None:
        """SIGKILL the worker and its process group, unless it has ended already (its pid may be reused)."""
        try:
            ended = self.conn.poll(0)  # an EOF waits on the connection of a worker that has ended
        except OSError:
            ended = True
        if not ended:
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
            answer = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            conn.close()
            raise WorkerCrashed(f"the worker process of {self.what} {how_it_ended(zygote.exit_code(pid))} while "
                                "loading it") from None
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
        self.release(worker)
        return _outcome(reply, self.what, worker.pid)

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
    try:
        kind, *rest = pickle.loads(reply)
    except Exception as exc:  # noqa: BLE001 - e.g. a class only the worker can import
        return Outcome(error=WorkerError(f"the reply of {what}'s worker process cannot be read here: "
                                         f"{type(exc).__name__}: {exc}"), pid=pid)
    if kind == "ok":
        value, records = rest
        return Outcome(value=value, records=records, pid=pid)
    if kind == "raised":
        error, text, records = rest
        error.__cause__ = WorkerTraceback(f"in the worker process:\n{text}")
        return Outcome(error=error, records=records, pid=pid)
    message, records = rest
    return Outcome(error=WorkerError(f"{what} returned {message}"), records=records, pid=pid)


# ----------------------------------------------------------------------------------------- the processes' side
def _zygote_main(fd: int, trainer: int) -> None:
    """Entry point of the spawned zygote: read ``sys.path`` and the modules to preload, then serve."""
    sock = socket.socket(fileno=fd)
    try:
        conn = Connection(os.dup(fd))
        path, preload = pickle.loads(conn.recv_bytes())
        conn.close()
        sys.path[:] = path
        for module in preload:
            try:
                __import__(module)
            except BaseException:  # noqa: BLE001 - preloading only saves time; the worker imports it or says why
                pass
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


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _recorder(key: str, check: Callable[..., tuple[Any, ...]] | None,
              records: list[tuple[str, tuple[Any, ...]]]) -> Callable[..., None]:
    def record(*args: Any) -> None:
        records.append((key, tuple(check(*args)) if check is not None else args))

    return record


def _serve(conn: Connection, fn: Any) -> None:
    """Answer calls until the trainer closes the connection."""
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
            reply = ("raised", _sendable(exc), traceback.format_exc(), records)
        conn.send_bytes(_dumped(reply))
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed or replaced stream
                pass


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _sendable(exc: BaseException) -> BaseException:
    """``exc`` where it survives pickling both ways, else a :class:`WorkerError` with its type and message."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - e.g. an exception class whose __init__ takes other arguments
        return WorkerError(f"{_one_line(exc)} (its exception could not be sent back from the worker process)")


def _dumped(reply: tuple[Any, ...]) -> bytes:
    try:
        return pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001 - an unpicklable result: the call's failure, with its repr
        try:
            shown = repr(reply[1])
        except Exception:  # noqa: BLE001
            shown = f"<{type(reply[1]).__name__}>"
        shown = shown if len(shown) <= 200 else shown[:200] + "..."
        message = (f"a {type(reply[1]).__name__} that cannot be sent back from its worker process "
                   f"({_one_line(exc)}): {shown}")
        try:
            return pickle.dumps(("unpicklable", message, reply[-1]))
        except Exception:  # noqa: BLE001 - the records too
            return pickle.dumps(("unpicklable", message, []))
