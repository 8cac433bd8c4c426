"""The generator process's side of pipelined generation: the jobs it runs and its main loop.

:func:`worker_main` is the process's entry point (started by :class:`~rlflow.rollout.process.GeneratorProcess`,
or early by :mod:`rlflow.rollout.prestart`): it imports what generation needs, waits for the shared-memory copy
of the policy, builds the rollout backend on it and runs :class:`Job` after :class:`Job` (:func:`run_job`), answering
with a :class:`JobResult` of plain lists; told to let go of the run (``("detach",)``: a worker kept for the next
run of the trainer's process, :func:`rlflow.rollout.prestart.park`), it drops the model and the backend and waits
for the next attach. A job is seeded, so its completions depend only on the weights, the
prompts and the seed. Two hooks run between the engine's decode iterations: a hold while the trainer has the
cores (:func:`_pause_hook`) and, for partial rollouts, the swap to new weights (:func:`_swap_hook`).

This module imports torch only inside the functions that run in the worker, so that the trainer can name the
entry point before it has imported torch (:mod:`rlflow.rollout.prestart`).
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import queue
import time
import traceback
from dataclasses import dataclass
from typing import Any

from rlflow.quiet import quiet_third_party
from rlflow.rollout.base import Completion, SamplingParams, pad_with_eos


@dataclass
class Job:
    """One generation request: ``n`` completions per prompt from the weights of ``version``, seeded."""

    step: int
    version: int
    seed: int
    prompts: list[list[int]]
    params: SamplingParams
    n: int
    delay: float = 0.0  # seconds to sleep before generating (tests: an adversarially slow generator)
    swap_at: int | None = None  # partial rollouts: the decode iteration before which new weights come in
    call_key: int | None = None  # a share of the trainer's sampling call (rlflow.rollout.split): its key...
    first: int = 0  # ...and the call's index of this job's first prompt


@dataclass
class JobResult:
    """The completions of a :class:`Job` as plain lists (``[prompt][sample] = (token_ids, logprobs, reason,
    token_versions or None)``); ``version`` is the version the job started from (its oldest tokens').

    ``swapped_to``: the version the worker switched to in the middle of the job (partial rollouts), else None."""

    step: int
    version: int
    prompts: list[list[int]]
    groups: list[list[tuple[list[int], list[float], str, list[int] | None]]]
    seconds: float
    swapped_to: int | None = None

    def completions(self) -> list[list[Completion]]:
        return [[Completion(list(ids), list(lps), reason, token_versions=None if vs is None else list(vs))
                 for ids, lps, reason, vs in group] for group in self.groups]

    @property
    def num_tokens(self) -> int:
        return sum(len(c[0]) for group in self.groups for c in group)

    def to_state(self) -> dict[str, Any]:
        """Plain types only (a checkpoint is read with ``torch.load(weights_only=True)``)."""
        return {"step": self.step, "version": self.version, "prompts": self.prompts, "seconds": self.seconds,
                "swapped_to": self.swapped_to,
                "groups": [[[list(ids), list(lps), reason, None if vs is None else list(vs)]
                            for ids, lps, reason, vs in g] for g in self.groups]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> JobResult:
        groups = [[(list(c[0]), list(c[1]), str(c[2]), list(c[3]) if len(c) > 3 and c[3] is not None else None)
                   for c in g] for g in state["groups"]]
        swapped = state.get("swapped_to")
        return cls(int(state["step"]), int(state["version"]), [list(p) for p in state["prompts"]], groups,
                   float(state["seconds"]), None if swapped is None else int(swapped))


def plain_groups(groups: list[list[Completion]]) -> list[list[tuple[list[int], list[float], str, list[int] | None]]]:
    """Completions as the plain tuples of :class:`JobResult`."""
    return [[(list(c.token_ids), [float(x) for x in c.logprobs], c.finish_reason,
              None if c.token_versions is None else list(c.token_versions)) for c in g] for g in groups]


def _next_message(jobs: Any, parent: Any) -> Any:
    """The next message of the queue; None when told to stop or when the parent process has died."""
    while True:
        try:
            return jobs.get(timeout=0.5)
        except queue.Empty:
            if parent is not None and not parent.is_alive():
                return None  # the trainer was killed: do not linger


class _Stopped(Exception):
    """The worker was told to stop (or lost its parent) while waiting for new weights in the middle of a job."""


def _pause_hook(running: Any, parent: Any) -> Any:
    """The engine's ``step_hook`` that holds the job between two decode iterations while the trainer has the
    generator's cores (``running`` cleared: :meth:`GeneratorProcess.pause`). The pause changes when tokens are
    sampled, never which: the weights and the draws do not move meanwhile."""

    def hook(iteration: int) -> bool:
        while not running.wait(0.5):
            if parent is not None and not parent.is_alive():
                raise _Stopped
        return False

    return hook


def _swap_hook(job: Job, backend: Any, jobs: Any, results: Any, parent: Any, swapped: list[int]) -> Any:
    """The engine's ``step_hook`` for a partial-rollout job: before decode iteration ``job.swap_at``, ask the
    trainer for new weights and wait for them (the trainer writes them while this process waits)."""

    def hook(iteration: int) -> bool:
        if iteration != job.swap_at:
            return False
        results.put(("swap", job.step))
        message = _next_message(jobs, parent)
        if not (isinstance(message, tuple) and message[0] == "weights"):
            raise _Stopped
        backend.version = int(message[1])
        swapped.append(backend.version)
        return True

    return hook


def run_job(job: Job, backend: Any, jobs: Any = None, results: Any = None, parent: Any = None,
            running: Any = None) -> JobResult:
    """Generate ``job`` on ``backend`` (seeded; with a swap of weights at ``job.swap_at`` for partial rollouts),
    holding it between decode iterations while ``running`` (an event) is cleared, where the backend has a
    ``step_hook`` (the engine)."""
    if job.delay:
        time.sleep(job.delay)
    import torch

    torch.manual_seed(job.seed)
    if hasattr(backend, "reseed"):  # a seeded engine: its own counter-based draws (rlflow.rollout.draws)
        backend.reseed(job.seed)
    backend.sync_weights()  # the trainer may have copied new weights in (invisible to version counters here)
    swapped: list[int] = []
    partial = job.swap_at is not None
    pausable = running is not None and hasattr(backend, "step_hook")
    if pausable:
        backend.step_hook = _pause_hook(running, parent)
    if partial:  # every cache a swap keeps is a row's own: no rollout-wide head shared across the swap
        swap = _swap_hook(job, backend, jobs, results, parent, swapped)
        pause = backend.step_hook if pausable else None
        backend.step_hook = swap if pause is None else (lambda iteration: pause(iteration) or swap(iteration))
        backend.version, shared = job.version, backend.min_shared_prefix
        backend.min_shared_prefix = 0
    start = time.perf_counter()
    try:
        groups = share_of_call(backend, job) if job.call_key is not None else \
            backend.generate(job.prompts, job.params, n=job.n)
    finally:
        if pausable or partial:
            backend.step_hook = None
        if partial:
            backend.version, backend.min_shared_prefix = None, shared
    seconds = time.perf_counter() - start
    return JobResult(job.step, job.version, job.prompts, plain_groups(groups), seconds,
                     swapped[0] if swapped else None)


def share_of_call(backend: Any, job: Job) -> list[list[Completion]]:
    """The job's prompts sampled as prompts ``job.first, ...`` of the trainer's call of key ``job.call_key``
    (:meth:`~rlflow.rollout.engine.EngineRollout.serve_call`): what the trainer's engine would sample for them."""
    from rlflow.rollout.base import in_prompt_order

    return in_prompt_order(backend.serve_call(job.prompts, job.call_key, job.params, job.n, first=job.first),
                           len(job.prompts))


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return pad_with_eos(AutoTokenizer.from_pretrained(path))


def worker_main(threads: int, jobs: Any, results: Any, tokenizer_path: str | None = None, running: Any = None) -> None:
    """The worker process: import what generation needs (and load the tokenizer, if given), wait for the shared
    model, build the backend on it, then run jobs until told to stop (held while ``running`` is cleared) or, kept
    for the next run, to let go of this one (then again from the wait for a model). The process exits when this
    returns; everything still alive is frozen out of the garbage collector first
    (``gc.freeze``), since the interpreter's last collection would walk every object torch and transformers
    created while the trainer waits for the worker to end."""
    try:
        _work(threads, jobs, results, tokenizer_path, running)
    finally:
        gc.freeze()


def _work(threads: int, jobs: Any, results: Any, tokenizer_path: str | None, running: Any) -> None:
    parent = mp.parent_process()
    quiet_third_party()  # before transformers imports torchao, as in the trainer
    try:
        import torch

        torch.set_num_threads(max(int(threads), 1))
        import rlflow.rollout.select  # noqa: F401 - the backends, imported while the trainer loads its model
        import rlflow.training.packing  # noqa: F401 - registers rlflow's attention function, as in the trainer
        from rlflow.training.host_memory import release_free_memory

        early = (tokenizer_path, _load_tokenizer(tokenizer_path)) if tokenizer_path else None
    except BaseException:  # noqa: BLE001 - reported to the trainer, which raises it
        results.put(("error", traceback.format_exc()))
        return
    while True:  # one run's attach, its jobs, then (a worker kept for the next run, rlflow.rollout.prestart) again
        backend = _attached(jobs, results, parent, early)
        if backend is None or not _serve(backend, jobs, results, parent, running):
            return
        early = None
        del backend  # the run's model (shared memory), tokenizer and backend let go of
        gc.collect()
        release_free_memory()  # an idle worker keeps the imports, not the run's caches
        results.put(("detached", os.getpid()))


def _attached(jobs: Any, results: Any, parent: Any, early: tuple[str, Any] | None) -> Any:
    """Wait for ``("attach", model, tokenizer_path, spec, environment)`` and build the backend on that model
    (answering ``("ready", pid)``); None when told to stop or when it cannot (answering ``("error", traceback)``).
    ``environment`` (a worker kept from an earlier run): the adopting trainer's ``os.environ``, taken over."""
    attach = _next_message(jobs, parent)
    if attach is None:
        return None
    try:
        from rlflow import registry
        from rlflow.rollout.select import resolve_backend

        _, model, path, spec, *rest = attach
        if rest and rest[0] is not None:
            os.environ.clear()
            os.environ.update(rest[0])
        tokenizer = early[1] if early is not None and path == early[0] else _load_tokenizer(path)
        if isinstance(spec, type):
            backend = spec()
            backend.bind(model, tokenizer)
        else:
            backend = resolve_backend(spec, model, tokenizer) if spec is not None else registry.build(
                "rlflow.rollout", "hf")
        results.put(("ready", os.getpid()))
    except BaseException:  # noqa: BLE001 - reported to the trainer, which raises it
        results.put(("error", traceback.format_exc()))
        return None
    return backend


def _serve(backend: Any, jobs: Any, results: Any, parent: Any, running: Any) -> bool:
    """Run jobs on ``backend`` until told to stop (False) or to let go of it (``("detach",)``: True)."""
    while True:
        job = _next_message(jobs, parent)
        if job is None:
            return False
        if isinstance(job, tuple) and job and job[0] == "detach":
            return True
        try:
            results.put(("done", run_job(job, backend, jobs, results, parent, running)))
        except _Stopped:
            return False
        except BaseException:  # noqa: BLE001
            results.put(("error", traceback.format_exc()))
