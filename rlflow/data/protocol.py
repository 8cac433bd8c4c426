"""What :class:`~rlflow.training.module.GRPOModule` needs from its datamodule: the one interface between the two.

The module owns the models and the update; the datamodule owns prompts, generation, judging, advantages and the
replay buffer. A GRPO step asks for fresh experience (:meth:`ExperienceSource.make_experience`), takes it back
as mini-batches (:meth:`~ExperienceSource.minibatches`) and tells the rollout backend after every optimizer step
(:meth:`~ExperienceSource.sync_weights`). :class:`~rlflow.data.datamodule.RolloutDataModule` implements it; a
datamodule of another design (an environment-driven one, say) can too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from rlflow.data.experience import Experience, RolloutStep
from rlflow.rollout.base import SamplingParams


@runtime_checkable
class ExperienceSource(Protocol):
    """The datamodule as the GRPO step sees it."""

    #: The tokenizer of the policy (padding id, HF export).
    tokenizer: Any
    #: Completions per evaluation prompt (pass@k is reported when it is above 1).
    eval_k: int
    #: Every ``data_source`` of the eval set, the same list on every rank (per-source eval metrics).
    eval_data_sources: list[str | None]
    #: How training rollouts sample: the log-probs are computed at its ``temperature``, and loss normalisers
    #: read its ``max_tokens``.
    sampling: SamplingParams
    #: ``data.pipeline.max_staleness``: 0 for the strictly on-policy loop, else how many policy versions an
    #: experience may lag behind the weights it trains (the module checks the bound and turns on the correction).
    max_staleness: int

    def bind(self, policy: Any, current_version: Callable[[], int] | None = None) -> None:
        """Point the rollout backend at the live policy (before the first rollout or evaluation);
        ``current_version()`` tells the policy version at any time (partial rollouts read it mid-generation)."""

    def all_cores(self) -> contextlib.AbstractContextManager:
        """The context the backward pass runs in (a pipelined run on a CPU lends it the generator's cores)."""

    @property
    def reads_policy_weights(self) -> bool:
        """Whether generation runs the policy module itself (an FSDP-sharded policy is unsharded around it)."""

    def make_experience(self, batch: list[Any], policy_version: int, step: int) -> RolloutStep:
        """Generate, judge and score one rollout step's prompts and put the experience in the replay buffer."""

    def minibatches(self, num: int) -> list[list[Experience]]:
        """Empty the replay buffer into ``num`` shuffled mini-batches, one per optimizer step."""

    def sync_weights(self) -> None:
        """Called after every optimizer step so the next rollout samples from the new weights."""

    def evaluate(self, batch: list[Any], step: int, batch_idx: int) -> dict[str, Any]:
        """Generate and judge one evaluation batch (``rewards``, ``correct``, ``lengths``, ``data_sources``; optionally
        ``failed``, per sample whether a judger failed on it, for ``eval/judger_failures``)."""
