"""The rollout-backend contract: prompts in, sampled completions with their log-probs out.

A backend registers under the ``rlflow.rollout`` entry-point group and subclasses :class:`RolloutBackend`. The
trainer uses exactly what this class declares, nothing found by ``getattr`` or ``inspect``:

* :meth:`~RolloutBackend.bind` once, with the live policy and the tokenizer;
* :meth:`~RolloutBackend.generate` (or :meth:`~RolloutBackend.stream` where :attr:`~RolloutBackend.streams` is
  true) on every rollout step, with token-id prompts and ``n`` (the group size), reporting progress through an
  optional ``progress(completions, tokens)`` callable;
* :meth:`~RolloutBackend.sync_weights` after every optimizer step (a colocated backend that reads the live weights
  does nothing there; a separate engine pushes the new weights);
* :attr:`~RolloutBackend.reads_policy_weights`: whether generation runs the policy module itself, so that an
  FSDP-sharded policy is unsharded around it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from rlflow.config_checks import Rule, SettingsGroup, at_least, greater_than, interval
from rlflow.config_error import ConfigError

Progress = Callable[[int, int], None]
"""``progress(completions, tokens)``: called as completions finish, with how many and their token count."""


@dataclass
class SamplingParams:
    """How completions are sampled. ``temperature`` 0 means greedy; ``top_k`` 0, ``top_p`` 1, ``min_p`` 0 and
    ``repetition_penalty`` 1 disable them. ``min_p`` keeps the tokens whose probability is at least ``min_p`` times
    the most likely one's (after top-k and top-p, in transformers' order); ``repetition_penalty`` acts on the logits
    of tokens already in the row, before the temperature (:mod:`rlflow.rollout.penalty`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 <= self.min_p < 1.0:
            raise ConfigError(f"min_p must be in [0, 1) (0 disables it), got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise ConfigError(f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}")
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class SamplingSettings(SettingsGroup):
    """``data.sampling``: how training rollouts sample completions (evaluation: ``data.eval``)."""

    key: ClassVar[str] = "data.sampling"
    rules: ClassVar[dict[str, Rule]] = {
        "temperature": at_least(0.0), "top_p": interval(0.0, 1.0, low_open=True), "top_k": at_least(0),
        "min_p": interval(0.0, 1.0, high_open=True), "repetition_penalty": greater_than(0.0), "max_tokens": at_least(1)}

    temperature: float = 1.0
    """Sampling temperature of training rollouts, and the temperature the training log-probs are computed at."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 disables it)."""
    top_k: int = 0
    """Top-k sampling (0 disables it)."""
    min_p: float = 0.0
    """Min-p sampling: keep the tokens whose probability is at least ``min_p`` times the most likely token's (0
    disables it; applied after top-k and top-p, as transformers and vLLM do). It truncates the sampling
    distribution only: the log-probs the trainer uses are the policy's."""
    repetition_penalty: float = 1.0
    """The logit of a token already in the prompt or the completion is divided by it where positive and multiplied
    where negative, before the temperature (transformers', vLLM's and LMDeploy's; 1.0 disables it). The rollout
    log-probs are those of the penalised distribution, so ``model.rollout_correction`` corrects for it; evaluation
    samples without it."""
    stop: list[str] | None = None
    """Extra stop strings, each a single token of the tokenizer; the tokenizer's EOS always stops."""
    max_tokens: int = 256
    """Most tokens generated per completion (per trajectory in multi-turn rollouts)."""

    def params(self, stop_token_ids: list[int] | None = None) -> SamplingParams:
        """The backends' :class:`SamplingParams` of these settings (``stop`` resolved to ``stop_token_ids``)."""
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.max_tokens, list(stop_token_ids or []),
                              min_p=self.min_p, repetition_penalty=self.repetition_penalty)


def pad_with_eos(tokenizer: Any) -> Any:
    """``tokenizer``, padding with its EOS token when it has no pad token (batches are padded for generation)."""
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def stop_token_ids(tokenizer: Any, stop: list[str]) -> list[int]:
    """The tokenizer's EOS plus the id of each ``stop`` string, which must be a single token."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    for s in stop:
        encoded = tokenizer.encode(s, add_special_tokens=False)
        if len(encoded) != 1:
            raise ValueError(
                f"data.sampling.stop entry {s!r} is {len(encoded)} tokens for this tokenizer; stop strings must be "
                "one token"
            )
        ids.append(encoded[0])
    return ids


@dataclass
class Completion:
    """One sampled completion.

    ``token_ids`` include the stop token when one ended it (the policy must learn to stop); ``logprobs`` are the
    sampling distribution's log-probs of those tokens, ``log_softmax(logits / temperature)`` before top-k/top-p
    truncation (what the trainer computes too, so the two can be compared); ``finish_reason`` is ``stop`` or
    ``length``.

    A multi-turn trajectory (:mod:`rlflow.rollout.multiturn`) is one completion too: ``token_ids`` are every token
    after the prompt, ``mask`` is True on the ones the model sampled (tool and environment tokens are context,
    their ``logprobs`` 0), ``prompt_ids`` is set when the environment wrote the prompt, ``messages`` is the
    conversation after the prompt (what judgers see), ``env_reward`` the environment's summed reward and ``info``
    the turn and tool-call counts. Single-turn completions leave them None.

    ``token_versions`` (partial rollouts, :mod:`rlflow.rollout.pipeline`) is the policy version that sampled each
    token, when a weight update reached the generator in the middle of the completion; None otherwise.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    mask: list[bool] | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    env_reward: float | None = None
    info: dict[str, Any] | None = None
    token_versions: list[int] | None = None

    @property
    def num_sampled(self) -> int:
        """Tokens the model sampled (all of them for a single-turn completion)."""
        return len(self.token_ids) if self.mask is None else sum(self.mask)


class UnsupportedModelError(ConfigError):
    """A backend cannot run this model; ``reason`` says why (``data.rollout=auto`` falls back to ``hf`` on it).

    A :class:`~rlflow.config_error.ConfigError`: naming a backend that cannot run the configured model is a
    configuration mistake, printed by the CLI as one line.
    """

    def __init__(self, backend: str, reason: str) -> None:
        super().__init__(f"the {backend} rollout backend cannot run this model: {reason}; "
                         "use data.rollout=auto (or hf), which falls back to the hf backend")
        self.backend, self.reason = backend, reason


def in_prompt_order(groups: Iterable[tuple[int, list[Completion]]], count: int) -> list[list[Completion]]:
    """The ``(prompt index, group)`` pairs of a stream (any order) as a list in prompt order: ``generate`` from
    ``stream``."""
    ordered: list[Any] = [None] * count
    for i, group in groups:
        ordered[i] = group
    return ordered


class RolloutBackend:
    """Base class of rollout backends: subclass it and override :meth:`generate` (and :meth:`stream` if the
    backend can hand out groups as they finish)."""

    #: Generation runs the policy module itself (True: ``hf``, ``engine``), so an FSDP-sharded policy must be
    #: unsharded around it; False for an engine with its own copy of the weights (``lmdeploy``).
    reads_policy_weights: bool = True
    #: The backend generates from prompts with images: it is given :class:`rlflow.models.vision.ImagePrompt` s (token-id
    #: lists that carry their images) and uses the images. A backend that would ignore them keeps False, and data
    #: with images is then refused with a ConfigError instead of silently generating without the pixels.
    accepts_images: bool = False
    #: :meth:`stream` yields each group as soon as it finishes, so judging can overlap generation; when False,
    #: the default :meth:`stream` yields the groups only after :meth:`generate` returned them all.
    streams: bool = False

    def bind(self, model: Any, tokenizer: Any) -> None:
        """Point the backend at the live policy (before the first rollout, and again before evaluation); raise
        :class:`UnsupportedModelError` if it cannot run it."""
        self.model = model
        self.tokenizer = tokenizer

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1,
                 progress: Progress | None = None) -> list[list[Completion]]:
        """``n`` completions for each prompt, in prompt order; ``progress`` is called as completions finish."""
        raise NotImplementedError(f"{type(self).__name__} does not implement generate()")

    def stream(self, prompts: list[list[int]], params: SamplingParams, n: int = 1,
               progress: Progress | None = None) -> Iterator[tuple[int, list[Completion]]]:
        """Yield ``(prompt_index, its n completions)`` for every prompt; see :attr:`streams`."""
        yield from enumerate(self.generate(prompts, params, n=n, progress=progress))

    def sync_weights(self) -> None:
        """Make the next :meth:`generate` use the current policy weights."""
