"""Start the generator process before the trainer imports Lightning (``rlflow fit`` only).

A pipelined run (``data.pipeline.max_staleness > 0``) generates in a second process (:mod:`rlflow.rollout.process`)
that imports torch, transformers and rlflow before its first job, which takes about as long as the trainer's own
imports. Started from the data module's ``setup("fit")``, the earliest point that knows the config, that start-up
shows up as the trainer's wait for step 1's completions. So the ``rlflow`` console script reads
``data.pipeline.max_staleness`` from the command line before it imports anything heavy and, when it is above 0,
starts the worker at once (:func:`from_argv`; also for ``data.pipeline.split_rollout: true``, whose on-policy
rollouts the worker shares, :mod:`rlflow.rollout.split`): its imports run beside the trainer's, and
:class:`~rlflow.rollout.process.GeneratorProcess` adopts it (:func:`adopt`) instead of starting another.

This module and :mod:`rlflow.rollout.worker` import only the standard library and PyYAML (the worker imports
torch when it starts), so that the start is not delayed.

Simplifications: a prediction from plain YAML, not jsonargparse's parse: the ``--config``/``-c`` files (later ones
win) and ``--data.pipeline.max_staleness``, ``--data.pipeline.generator_threads``, ``--data.pipeline.split_rollout``
and ``--data.rollout``
given on the command line;
anything else (a ``--data`` file, a value that is not a plain number) predicts nothing, and the run starts its
worker at ``setup("fit")`` as before. A prediction that the parsed config overrules costs a process that stops
at ``setup`` (:func:`discard`) or with the trainer (it is a daemon). ``data.rollout: lmdeploy`` needs no process
(a thread sends its requests) and starts none.

Several runs in one Python process (the Python API: a sweep, a notebook) share their workers: a run that ends with
its worker idle and healthy hands it back (:func:`park`; the worker lets go of that run's model) and the next run
with as many generator threads adopts it (:func:`unpark`) instead of starting another process and importing torch
and transformers again. A kept worker waits :data:`PARK_SECONDS` for a run, then stops; at most one is kept per
thread count. The ``rlflow`` console script, whose process ends with its run, keeps none (:data:`KEEP_WORKERS`).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import queue
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

from rlflow.rollout.worker import worker_main

#: The worker started early and not adopted yet: (process, jobs queue, results queue, running event, start time,
#: torch threads).
_EARLY: tuple[Any, ...] | None = None
#: Every worker started and not stopped yet: (process, jobs queue).
_SPAWNED: list[tuple[Any, Any]] = []
#: Workers handed back by a finished run, by torch threads: (process, jobs queue, results queue, running event,
#: the timer that stops it).
_PARKED: dict[int, tuple[Any, ...]] = {}
_PARKED_LOCK = threading.Lock()
#: Seconds a worker handed back waits for the next run of this process before it is stopped.
PARK_SECONDS = 300.0
#: Whether a finished run's idle worker is kept for the next run of this process (:func:`park`); the ``rlflow``
#: console script turns it off.
KEEP_WORKERS = True


@contextlib.contextmanager
def _stop_signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored for the block (from the main thread; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {number: signal.signal(number, signal.SIG_IGN) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in before.items():
            signal.signal(number, handler if handler is not None else signal.SIG_DFL)


def spawn_worker(threads: int, tokenizer_path: str | None = None) -> tuple[Any, Any, Any, Any, float]:
    """Start a generator worker process: ``(process, jobs queue, results queue, running event, start time)``.

    The worker ignores SIGINT and SIGTERM (it starts with them ignored, which ``spawn`` passes on): a Ctrl-C
    reaches the whole process group and a scheduler may signal every process of a job, and the trainer, which
    stops at the end of its step (:class:`~rlflow.training.checkpointing.GracefulStop`), still needs its worker
    until then. The worker ends when told to, when its parent is gone, or by SIGKILL
    (:meth:`~rlflow.rollout.process.GeneratorProcess.close`)."""
    ctx = mp.get_context("spawn")
    jobs, results, running = ctx.Queue(), ctx.Queue(), ctx.Event()
    running.set()
    process = ctx.Process(target=worker_main, name="rlflow-generator", daemon=True,
                          args=(threads, jobs, results, tokenizer_path, running))
    started = time.perf_counter()
    with _stop_signals_ignored():
        process.start()
    _SPAWNED.append((process, jobs))
    atexit.unregister(_stop_spawned)  # registered last, it runs before multiprocessing's own exit handler
    atexit.register(_stop_spawned)
    return process, jobs, results, running, started


def _stop_spawned() -> None:
    """At exit, stop the workers nobody stopped (a run that failed or was refused before it closed its generator):
    multiprocessing's exit handler would send them SIGTERM, which they ignore, and wait for them forever. Workers
    kept for a next run are among them."""
    stop_parked(wait=1.0)
    for process, jobs in list(_SPAWNED):
        stop_worker(process, jobs, wait=1.0)


def start(threads: int) -> None:
    """Start a generator worker with ``threads`` torch threads now, for :func:`adopt` to hand out later (stopped
    at exit if no one did, as every worker :func:`spawn_worker` starts)."""
    global _EARLY
    if _EARLY is not None:
        return
    _EARLY = (*spawn_worker(threads), threads)


def adopt(threads: int) -> tuple[Any, Any, Any, Any, float] | None:
    """The early worker, if one runs with ``threads`` threads: ``(process, jobs, results, running, start time)``;
    it is handed out once. One with other threads is stopped (None: the caller starts its own)."""
    global _EARLY
    early, _EARLY = _EARLY, None
    if early is None:
        return None
    process, jobs, results, running, started, early_threads = early
    if early_threads != threads or not process.is_alive():
        stop_worker(process, jobs)
        return None
    return process, jobs, results, running, started


def discard() -> None:
    """Stop the early worker, if no one adopted it (the parsed config does not pipeline)."""
    global _EARLY
    early, _EARLY = _EARLY, None
    if early is not None:
        stop_worker(early[0], early[1])


def park(process: Any, jobs: Any, results: Any, running: Any, threads: int, attached: bool, wait: float) -> bool:
    """Keep an idle worker whose run has ended for the next run of this process with ``threads`` threads
    (:func:`unpark`); False where it is not kept (:data:`KEEP_WORKERS` off, the worker gone, or, for a worker
    that was ``attached`` to a model, no word within ``wait`` seconds that it let go of it): the caller stops it.
    A worker kept earlier with as many threads is stopped; this one is stopped after :data:`PARK_SECONDS`."""
    if not KEEP_WORKERS or not process.is_alive():
        return False
    if attached and not _detached(process, jobs, results, wait):
        return False
    running.set()
    timer = threading.Timer(PARK_SECONDS, _expire, args=(threads, process))
    timer.daemon = True
    with _PARKED_LOCK:
        older = _PARKED.pop(threads, None)
        _PARKED[threads] = (process, jobs, results, running, timer)
    if older is not None:
        older[4].cancel()
        stop_worker(older[0], older[1])
    timer.start()
    return True


def _detached(process: Any, jobs: Any, results: Any, wait: float) -> bool:
    """Tell an attached worker to let go of its model and backend; whether it said it did within ``wait`` s (its
    answer to the attach, if still on its way, is passed over)."""
    deadline = time.monotonic() + wait
    try:
        jobs.put(("detach",))
        while time.monotonic() < deadline:
            try:
                kind, _ = results.get(timeout=min(0.5, max(deadline - time.monotonic(), 0.01)))
            except queue.Empty:
                if not process.is_alive():
                    return False
                continue
            if kind == "detached":
                return True
            if kind != "ready":
                return False
    except (OSError, ValueError, EOFError, TypeError):
        return False
    return False


def unpark(threads: int) -> tuple[Any, Any, Any, Any, float] | None:
    """The worker a finished run of this process handed back with ``threads`` threads, if one is alive:
    ``(process, jobs queue, results queue, running event, now)``; handed out once."""
    with _PARKED_LOCK:
        kept = _PARKED.pop(threads, None)
    if kept is None:
        return None
    process, jobs, results, running, timer = kept
    timer.cancel()
    if not process.is_alive():
        stop_worker(process, jobs)
        return None
    return process, jobs, results, running, time.perf_counter()


def _expire(threads: int, process: Any) -> None:
    """The timer of a kept worker: stop it if no run adopted it."""
    with _PARKED_LOCK:
        kept = _PARKED.get(threads)
        if kept is None or kept[0] is not process:
            return
        del _PARKED[threads]
    stop_worker(kept[0], kept[1])


def stop_parked(wait: float = 5.0) -> None:
    """Stop every worker kept for a next run (``wait``: as :func:`stop_worker`)."""
    with _PARKED_LOCK:
        kept = list(_PARKED.values())
        _PARKED.clear()
    for process, jobs, _, _, timer in kept:
        timer.cancel()
        stop_worker(process, jobs, wait)


def stop_worker(process: Any, jobs: Any, wait: float = 5.0) -> None:
    """Ask a worker to stop, give it ``wait`` seconds, then kill it (it ignores SIGTERM: :func:`spawn_worker`)."""
    if process.is_alive():
        try:
            jobs.put(None)
        except (OSError, ValueError):
            pass
        process.join(timeout=wait)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)
    jobs.cancel_join_thread()  # nothing left to deliver to a stopped worker: never wait for it at exit
    with contextlib.suppress(ValueError):
        _SPAWNED.remove((process, jobs))



def predict(argv: list[str]) -> tuple[int, int] | None:
    """``(data.pipeline.max_staleness, data.pipeline.generator_threads)`` as ``argv`` (after ``fit``) sets them, or
    None when it cannot tell or the run does not need a generator process (see the module doc): it needs one when
    pipelined, or on-policy with ``data.pipeline.split_rollout: true`` (:mod:`rlflow.rollout.split`)."""
    import yaml

    pipeline: dict[str, Any] = {}
    rollout: Any = ""
    i = 0
    while i < len(argv):
        key, _, value = argv[i].partition("=")
        if not _:  # "--key value" (a flag followed by another option takes no value)
            value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("-") else None
            i += value is not None
        i += 1
        if value is None:
            continue
        try:
            if key in ("--config", "-c"):
                with open(value, encoding="utf-8") as f:
                    loaded = yaml.safe_load(f) or {}
                data = loaded.get("data") if isinstance(loaded, dict) else None
                if isinstance(data, dict):
                    pipeline.update(data.get("pipeline") or {})
                    rollout = data.get("rollout", rollout)
            elif key.startswith("--data.pipeline."):
                pipeline[key[len("--data.pipeline."):]] = yaml.safe_load(value)
            elif key == "--data.pipeline":
                pipeline.update(yaml.safe_load(value) or {})
            elif key == "--data.rollout":
                rollout = value
        except (OSError, yaml.YAMLError, AttributeError, TypeError, ValueError):
            return None
    staleness, threads = pipeline.get("max_staleness", 0), pipeline.get("generator_threads", 1)
    if not (isinstance(staleness, int) and isinstance(threads, int)) or staleness < 0 or threads < 1:
        return None
    if staleness == 0 and pipeline.get("split_rollout") is not True:  # on-policy without a split: no process
        return None
    if "lmdeploy" in str(rollout).lower():
        return None
    return staleness, threads


def from_argv(argv: list[str]) -> None:
    """``rlflow fit ...``: start the generator worker now when the command line says the run is pipelined."""
    predicted = predict(argv)
    if predicted is not None:
        start(predicted[1])
