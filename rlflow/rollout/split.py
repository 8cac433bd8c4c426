"""On-policy rollouts decoded by two processes at once: the trainer and the generator process each take a share.

Why: on a CPU the engine's decode step of a small model is dozens of small operators on ``[rows, hidden]``
tensors, most below the size torch splits across threads, so a second thread speeds a rollout up far less than it
speeds the training forward and backward. Two processes of one thread each decode two halves of the prompts side
by side, and the training then has every core. With ``data.pipeline.split_rollout: true`` (and
``data.pipeline.max_staleness: 0``) the data module's rollout backend is a :class:`SplitRollout`: it copies the
current weights into the generator process's shared-memory copy (:class:`~rlflow.rollout.process.GeneratorProcess`,
the pipelined runs' worker), sends it the second half of the prompts, decodes the first half itself on the rest of
its torch threads, then yields the generator's groups.

Both processes sample from the trainer's own random streams: sample ``s`` of prompt ``i`` draws from ``(call key,
i, s)`` (:mod:`rlflow.rollout.draws`) whichever process decodes it, and the call key is the trainer engine's next
one, so the run's random state advances as without the split. A row's arithmetic does not depend on the rows
beside it here (each group attends to its own cache), so a split rollout samples what one process would, token
for token.

Judging overlaps generation as before for the trainer's half (its groups stream out as they finish); the
generator's half arrives at once at the end and is judged then. Nothing is in flight between rollout steps, so
checkpoints and resume are those of the plain loop.

Simplifications: the ``engine`` backend only, one process without FSDP2 (even on one rank), a policy on a CPU
whose LoRA adapters (``model.lora``) merge into plain weights (not DoRA) (elsewhere the run goes on without the
split and says why, :func:`split_problem` and the data module); two shares
split by prompt count (the first ``ceil(n / 2)`` prompts stay in the trainer); the generator idles while the
trainer trains (nothing else to do on-policy); multi-turn rollouts are not split.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from rlflow.rollout.base import Completion, Progress, RolloutBackend, SamplingParams, in_prompt_order
from rlflow.rollout.process import GeneratorProcess, Job
from rlflow.rollout.requests import check_call


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Torch's intra-op threads set to ``threads`` for the block, then put back."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class SplitRollout(RolloutBackend):
    """The trainer's ``engine`` backend with a generator process beside it that decodes a share of every call.

    Args:
        engine: The trainer's bound :class:`~rlflow.rollout.engine.EngineRollout` (it decodes the first share and
            supplies the call keys).
        threads: Torch threads of the generator process (``data.pipeline.generator_threads``); the trainer decodes
        its share
            on the rest of its own torch threads (at least one), so a rollout uses the threads it would without the
            split.
        generator: A started :class:`GeneratorProcess` (None: one is started with ``threads`` threads).
    """

    streams = True

    def __init__(self, engine: Any, threads: int = 1, generator: GeneratorProcess | None = None) -> None:
        self.engine = engine
        self.threads = threads
        self.generator = generator if generator is not None else GeneratorProcess(threads)
        self.local_threads = max(1, torch.get_num_threads() - threads)  # the trainer's threads, shared out

    def attach(self, tokenizer_path: str, spec: Any) -> None:
        """Give the generator process its shared-memory copy of the policy and the backend to build on it. The
        copy is built without drawing from torch's random generator (its random initialisation is overwritten),
        so the run's random stream, which an unseeded engine's call keys come from, is that of the plain loop."""
        with torch.random.fork_rng(devices=[]):
            self.generator.attach(self.engine.model, tokenizer_path, spec)

    @property
    def model(self) -> Any:
        return self.engine.model

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1,
                 progress: Progress | None = None) -> list[list[Completion]]:
        return in_prompt_order(self.stream(prompts, params, n, progress), len(prompts))

    def stream(self, prompts: list[list[int]], params: SamplingParams, n: int = 1,
               progress: Progress | None = None) -> Iterator[tuple[int, list[Completion]]]:
        """Yield ``(prompt index, its n completions)``: the trainer's share as each group finishes, then the
        generator's. The weights are those of the policy now (copied into the generator before it starts)."""
        check_call(prompts, n)
        key = 0 if params.greedy else self.engine.next_call_key()
        mine = (len(prompts) + 1) // 2
        if mine < len(prompts):
            self.generator.load_weights(self.engine.model)
            self.generator.submit(Job(0, 0, 0, prompts[mine:], params, n, call_key=key, first=mine))
        try:
            with torch_threads(self.local_threads):
                yield from self.engine.serve_call(prompts[:mine], key, params, n, progress)
        except (Exception, GeneratorExit):
            if self.generator.busy:
                self.generator.collect()  # never leave the worker busy
            raise
        # a run stopped at once (a signal's BaseException) does not wait for the worker: it ends with the trainer
        result = self.generator.collect() if self.generator.busy else None
        for j, group in enumerate(result.completions() if result is not None else []):
            if progress is not None:
                progress(len(group), sum(len(c.token_ids) for c in group))
            yield mine + j, group

    def sync_weights(self) -> None:
        self.engine.sync_weights()

    def close(self, wait: float = 5.0, keep: bool = True) -> None:
        """Close the generator process (``wait`` and ``keep`` as :meth:`GeneratorProcess.close` takes them)."""
        self.generator.close(wait, keep)


def split_problem(threads: int, world_size: int, sharded: bool, device: str, backend: Any = None) -> str | None:
    """Why a run cannot share its rollouts with a generator process of ``threads`` torch threads (None: it can).
    The split keeps the run within the trainer's torch threads, so it needs more than ``threads`` of them; one
    process (``world_size`` 1) without FSDP2 (``sharded``); the trainer on the CPU (``device``); and, once known,
    the ``engine`` backend (``data.rollout: auto`` picks ``hf`` for models the engine does not run) on a CPU policy
    whose LoRA adapters, if any, merge into the generator's plain copy (not DoRA:
    :func:`~rlflow.models.lora.merge_problem`). Without ``backend`` (the data module's ``setup``, before the policy
    exists) only the run's own settings count."""
    from rlflow.models.lora import merge_problem
    from rlflow.rollout.engine import EngineRollout

    if torch.get_num_threads() <= threads:
        return (f"the trainer has {torch.get_num_threads()} torch thread(s), none left beside the generator's "
                f"{threads} (data.pipeline.generator_threads)")
    if world_size > 1:
        return f"{world_size} ranks (FSDP) each decode their own share already"
    if sharded:
        return "the policy is sharded (FSDP2): its ranks decode their own shares"
    if device != "cpu":
        return f"the trainer is on {device} (the split decodes on CPU cores; on GPUs the lmdeploy backend generates)"
    if backend is None:
        return None
    if not isinstance(backend, EngineRollout):
        return f"the rollout backend is {type(backend).__name__}, not the engine"
    policy_device = next(backend.model.parameters()).device
    if policy_device.type != "cpu":
        return f"the policy is on {policy_device} (the split decodes on CPU cores; on GPUs the lmdeploy backend " \
               "generates)"
    unmerged = merge_problem(backend.model)
    if unmerged:
        return f"the generator process decodes a merged copy of the policy, and model.lora cannot be merged " \
               f"({unmerged})"
    return None
