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
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
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
    multiprocessing's exit handler would send them SIGTERM, which they ignore, and wait for them forever."""
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
