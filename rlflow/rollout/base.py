"""The rollout-backend contract: prompts in, sampled completions with their log-probs out.

A backend registers under the ``rlflow.rollout`` entry-point group. The trainer calls :meth:`bind` once with
the live policy and tokenizer, then :meth:`generate` on every rollout step with token-id prompts and ``n``
(the group size), and :meth:`sync_weights` after every optimizer step (a colocated backend that reads the live
weights does nothing there; a separate engine pushes the new weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlflow.config_error import ConfigError


@dataclass
class SamplingParams:
    """How completions are sampled. ``temperature`` 0 means greedy; ``top_k`` 0 and ``top_p`` 1 disable them."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Completion:
    """One sampled completion.

    ``token_ids`` include the stop token when one ended it (the policy must learn to stop); ``logprobs`` are the
    sampling distribution's log-probs of those tokens, ``log_softmax(logits / temperature)`` before top-k/top-p
    truncation (what the trainer computes too, so the two can be compared); ``finish_reason`` is ``stop`` or
    ``length``.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class RolloutBackend:
    """Base class of rollout backends."""

    def bind(self, model: Any, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[list[Completion]]:
        """``n`` completions for each prompt, in prompt order."""
        raise NotImplementedError

    def sync_weights(self) -> None:
        """Make the next :meth:`generate` use the current policy weights."""
