"""Generation off the training thread: a rollout backend in its own process (or, for a server, a thread).

This is the trainer's side; what runs in the worker process (its loop, :class:`Job`, :class:`JobResult`) is
:mod:`rlflow.rollout.worker`.

:class:`GeneratorProcess` starts one worker process (``torch.multiprocessing``, ``spawn``) that runs an ordinary
rollout backend (``engine`` or ``hf``, chosen by ``data.rollout`` as in the trainer) with its own torch threads.
Its model is a copy of the policy whose parameters live in shared memory (``Module.share_memory()``): the trainer
refreshes them in place with :meth:`GeneratorProcess.load_weights` (one ``copy_`` per parameter, no pickling of
the model per step; the tensors were handed to the worker once, at start, as shared-memory handles). Jobs
(token-id prompts, sampling parameters, a seed, the policy version of the weights) go through one queue and
completions, stamped with that version, come back through another.

The worker seeds torch's generator with the job's seed before generating, so a job's completions depend only on
the weights, the prompts and the seed, not on timing: the trainer decides when weights change
(:mod:`rlflow.rollout.pipeline` only writes them while the worker is idle). The worker ends with the trainer: it
ignores SIGINT and SIGTERM (a Ctrl-C or a scheduler's signal to every process leaves the stop to the trainer,
:func:`~rlflow.rollout.prestart.spawn_worker`), and exits when told to, when its parent dies (``kill -9`` of the
trainer leaves no orphan) or when its queue is closed; a trainer that exits without closing it (an exception, a
signal) kills it at exit, quietly.

Partial rollouts (a job with ``swap_at``, engine backend only): before decode iteration ``swap_at`` the worker
stops, tells the trainer (``("swap", step)``) and waits for new weights; the trainer writes them into the shared
copy while the worker waits and answers ``("weights", version)``; the worker then continues every row from its
KV cache under the new weights, stamping each token with the version that sampled it
(:attr:`~rlflow.rollout.base.Completion.token_versions`). The swap point is a decode iteration, not a moment, so
a job's completions still depend only on the weights, the prompts and the seed.

A backend that already generates outside the trainer's process on its own copy of the weights (``lmdeploy``:
:attr:`~rlflow.rollout.base.RolloutBackend.reads_policy_weights` false) needs no second process:
:class:`ThreadGenerator` sends its requests from a background thread, so the servers keep generating while the
trainer steps, and pushes weights (``push_weights``, with the FSDP gathers every rank joins) on the training
thread between two jobs, i.e. at request boundaries: no request ever sees two versions. Its engine must stay
awake during training (``sleep_level: null``: servers on GPUs of their own, or ``server_url``).

Simplifications: one job at a time; a backend given as an object (not a name) is rebuilt in the worker from its
class with default arguments; judging stays in the trainer process; a server samples with its own random state,
so a pipelined lmdeploy run is not bit-reproducible (the process generator's runs are).
"""

from __future__ import annotations

import collections
import copy
import os
import queue
import time
from typing import Any

import torch

from rlflow.models.lm_head import cast_lm_head_to_fp32, is_fp32_head
from rlflow.rollout import prestart
from rlflow.rollout.worker import Job, JobResult, plain_groups

__all__ = ["GeneratorProcess", "Job", "JobResult", "ThreadGenerator", "copy_weights", "generator_copy", "plain_groups"]


def generator_copy(policy: torch.nn.Module) -> torch.nn.Module:
    """A fresh module of the policy's architecture and dtype, weights copied in, parameters in shared memory."""
    from transformers import AutoModelForCausalLM

    from rlflow.training.packing import ATTENTION_NAME

    config = copy.deepcopy(policy.config)  # its own: the trainer switches the policy's attention around packed passes
    # the dtype most parameters have (a float32 head, cast_lm_head_to_fp32, may come first)
    dtype = collections.Counter(p.dtype for p in policy.parameters()).most_common(1)[0][0]
    kwargs: dict[str, Any] = {"dtype": dtype}
    attn = getattr(config, "_attn_implementation", None)
    if attn:
        kwargs["attn_implementation"] = "sdpa" if attn == ATTENTION_NAME else attn
    model = AutoModelForCausalLM.from_config(config, **kwargs)
    model.eval().requires_grad_(False)
    if is_fp32_head(policy.get_output_embeddings()):
        cast_lm_head_to_fp32(model)
    copy_weights(policy, model)
    return model.share_memory()


@torch.no_grad()
def copy_weights(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Copy every parameter of ``src`` into the parameter of the same name of ``dst`` (in place).

    An FSDP-sharded ``src`` must be unsharded around the call (:func:`rlflow.training.fsdp_units.full_weights`); a
    DTensor parameter is gathered all the same. A policy with LoRA adapters (``model.lora``) is copied merged, under
    the plain model's names (:func:`rlflow.models.lora.merge_lora_tensors`): ``dst`` is the model without adapters.
    """
    from rlflow.models.lora import merge_lora_tensors

    params = dict(dst.named_parameters())
    named = ((name, p.full_tensor() if hasattr(p, "full_tensor") else p) for name, p in src.named_parameters())
    for name, value in merge_lora_tensors(src, named):
        if name not in params:
            raise KeyError(f"the generator's model has no parameter {name!r}")
        params[name].copy_(value.detach().to(params[name].dtype))


class GeneratorProcess:
    """A rollout backend running in a child process on a shared-memory copy of the policy (see the module doc).

    The process starts (and imports torch, transformers and rlflow) as soon as it is built, before the policy
    exists; :meth:`attach` then hands it the shared copy of the policy and the backend to build. A worker that
    ``rlflow fit`` started before importing Lightning (:mod:`rlflow.rollout.prestart`) is adopted instead of
    starting another, as is the worker an earlier run of this process handed back when it closed
    (:func:`~rlflow.rollout.prestart.park`; that worker takes this process's ``os.environ`` at :meth:`attach`).

    :meth:`pause` and :meth:`resume` lend the worker's cores to the trainer for a while (its backward pass): an
    engine job waits between two decode iterations meanwhile; other backends are not held.

    Args:
        threads: torch threads of the worker.
        start_timeout: Seconds to wait for the worker to build its backend.
        tokenizer_path: The tokenizer the worker loads while it waits for the policy (else at :meth:`attach`).
    """

    def __init__(self, threads: int = 1, start_timeout: float = 600.0, tokenizer_path: str | None = None) -> None:
        self.model: torch.nn.Module | None = None
        self.threads = threads
        early = prestart.adopt(threads)
        kept = None if early is not None else prestart.unpark(threads)
        self.process, self.jobs, self.results, self.running, self.started_at = \
            early or kept or prestart.spawn_worker(threads, tokenizer_path)
        self.reused = kept is not None  # a worker of an earlier run: it takes this process's environment
        self.failed = False
        self.busy = False
        self.ready = False  # the worker's start-up (imports, backend check) overlaps the trainer's own
        self.start_timeout = start_timeout

    def attach(self, policy: torch.nn.Module, tokenizer_path: str, spec: Any) -> None:
        """Give the worker a shared-memory copy of ``policy`` (once) and the backend spec (``data.rollout``: a
        name or mapping, or a backend class) to run on it; ``tokenizer_path``: the tokenizer it loads."""
        if self.model is None:
            self.model = generator_copy(policy)
            self.jobs.put(("attach", self.model, tokenizer_path, spec, dict(os.environ) if self.reused else None))

    def wait_ready(self) -> None:
        """Block until the worker has built its backend (once); raise with its traceback if it could not."""
        if self.ready:
            return
        if self.model is None:
            raise RuntimeError("attach() the policy before the first job")
        kind, payload = self._receive(self.start_timeout)
        self._started(kind, payload)

    def _started(self, kind: str, payload: Any) -> None:
        if kind != "ready":
            self.failed = True
            self.close()
            raise RuntimeError(f"the generator process failed to start:\n{payload}")
        self.ready = True
        from rlflow.log import info

        info(f"generator process {payload} ready {time.perf_counter() - self.started_at:.1f} s after its start")

    def pause(self) -> None:
        """Hold the running job (an engine job: between two decode iterations) until :meth:`resume`."""
        self.running.clear()

    def resume(self) -> None:
        self.running.set()

    def _receive(self, timeout: float | None) -> tuple[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self.results.get(timeout=1.0)
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(f"the generator process died (exit code {self.process.exitcode})") from None
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the generator process gave no answer in {timeout} s") from None

    def load_weights(self, policy: torch.nn.Module) -> None:
        """Copy the policy's current weights into the shared copy; only while no job runs (the worker reads them)."""
        if self.busy:
            raise RuntimeError("load_weights while the generator is generating: the job would mix two versions")
        copy_weights(policy, self.model)

    def submit(self, job: Job) -> None:
        """Queue ``job``; it does not wait for the worker to be ready (a job submitted during the worker's start-up
        runs as soon as it is: the first rollout step's look-ahead overlaps the start-up)."""
        if self.busy:
            raise RuntimeError("the generator runs one job at a time; collect() the previous one first")
        if self.model is None:
            raise RuntimeError("attach() the policy before the first job")
        self.jobs.put(job)
        self.busy = True

    def collect(self, timeout: float | None = None, on_swap: Any = None) -> JobResult:
        """Wait for the job submitted last; raise (with the worker's traceback) if it failed.

        ``on_swap()`` (partial rollouts) is called when the worker stops for new weights in the middle of the job:
        it writes them (the worker waits meanwhile) and returns their version, which the worker stamps."""
        if not self.busy:
            raise RuntimeError("collect() without a submitted job")
        while True:
            kind, payload = self._receive(self.start_timeout if not self.ready else timeout)
            if not self.ready:
                self._started(kind, payload)
                continue
            if kind == "swap" and on_swap is not None:
                self.jobs.put(("weights", int(on_swap())))
                continue
            break
        self.busy = False
        if kind != "done":
            self.failed = True
            raise RuntimeError(f"the generator process failed:\n{payload}")
        return payload

    def close(self, wait: float = 5.0, keep: bool = True) -> None:
        """Stop the worker: ask it, give it ``wait`` seconds (a job in flight ends first), then kill it. With
        ``keep``, a worker with no job in flight and no failure is instead kept for the next run of this process
        (:func:`~rlflow.rollout.prestart.park`, which the ``rlflow`` console script turns off)."""
        self.running.set()
        if keep and not (self.busy or self.failed) and prestart.park(
                self.process, self.jobs, self.results, self.running, self.threads, self.model is not None, wait):
            self.model = None  # the worker let go of its shared copy
        else:
            prestart.stop_worker(self.process, self.jobs, wait)
        self.busy = False


class ThreadGenerator:
    """The :class:`GeneratorProcess` interface for a backend with its own weights elsewhere (an inference server):
    requests go out from one background thread; weights are pushed from the calling thread between jobs.

    Args:
        backend: A bound backend whose ``reads_policy_weights`` is false (it never reads the live policy while the
            trainer updates it); ``push_weights()``, if it has one, sends the current weights.
    """

    def __init__(self, backend: Any) -> None:
        from concurrent.futures import ThreadPoolExecutor

        if backend.reads_policy_weights:
            raise ValueError(f"{type(backend).__name__} generates from the live policy module; it cannot run while "
                             "the trainer updates it (the generator process handles such backends)")
        if getattr(backend, "colocated", False) and getattr(backend, "sleep_level", None) is not None:
            from rlflow.config_error import ConfigError

            raise ConfigError(
                "data.pipeline.max_staleness > 0 with a colocated lmdeploy engine that sleeps during training "
                "(data.rollout.init_args.sleep_level): pipelining needs the engine awake while the "
                "trainer steps; set sleep_level: null (engines on GPUs of their own) or server_url"
            )
        self.backend = backend
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlflow-generator")
        self.future: Any = None

    @property
    def busy(self) -> bool:
        return self.future is not None

    def load_weights(self, policy: torch.nn.Module) -> None:
        """Between jobs, on the training thread (every rank joins the gathers of a sharded policy)."""
        if self.busy:
            raise RuntimeError("load_weights while the generator is generating: the job would mix two versions")
        self.backend.sync_weights()
        push = getattr(self.backend, "push_weights", None)
        if push is not None:
            push()

    def _run(self, job: Job) -> JobResult:
        if job.delay:
            time.sleep(job.delay)
        if hasattr(self.backend, "reseed"):  # a seeded engine: its own counter-based draws (rlflow.rollout.draws)
            self.backend.reseed(job.seed)
        start = time.perf_counter()
        groups = self.backend.generate(job.prompts, job.params, n=job.n)
        return JobResult(job.step, job.version, job.prompts, plain_groups(groups), time.perf_counter() - start)

    def submit(self, job: Job) -> None:
        if self.busy:
            raise RuntimeError("the generator runs one job at a time; collect() the previous one first")
        self.future = self.pool.submit(self._run, job)

    def collect(self, timeout: float | None = None, on_swap: Any = None) -> JobResult:
        if not self.busy:
            raise RuntimeError("collect() without a submitted job")
        future, self.future = self.future, None
        return future.result(timeout=timeout)

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.future = None
