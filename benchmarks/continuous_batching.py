"""The benchmarks' continuous-batching anchor: :class:`ContinuousBatchingRollout`, transformers' ``generate_batch``.

``generate_batch`` is transformers' own batched sampler for many requests (paged KV cache, requests joining and
leaving the batch at every step, CUDA graphs on a GPU), the path TRL offers beside ``generate`` for its GRPO
rollouts. ``bench_rollout.py --continuous-batching`` times rlflow's engine against it, on the same model, prompts
and sampling settings as the ``model.generate`` anchor. As TRL's GRPOTrainer calls it: each prompt repeated once per
completion of its group, and a ``ContinuousBatchingConfig`` whose ``max_memory_percent`` is 0.5 (TRL's default,
which leaves memory for training) unless other settings are given. ``generate_batch`` sizes its KV cache and its
static input buffers from that share of the device's memory and fills them for every call; on a CPU that is the
host's memory, so a call has a fixed cost of seconds there, whatever the batch.

Not a registered backend: no per-token log-probs are asked for (the benchmark counts tokens only), and its draws come
from torch's global generator.
"""

from __future__ import annotations

from typing import Any

from transformers import GenerationConfig

from benchmarks.plain_generate import generate_settings
from rlflow.rollout.base import Completion, SamplingParams


class ContinuousBatchingRollout:
    """``model.generate_batch`` behind the ``bind`` / ``generate`` calls the rollout benchmarks make."""

    def __init__(self, **settings: Any) -> None:
        """``settings``: ``ContinuousBatchingConfig``'s fields (``num_blocks``, ``max_batch_tokens``, ...)."""
        from transformers.generation import ContinuousBatchingConfig

        self.settings = ContinuousBatchingConfig(**{"max_memory_percent": 0.5, **settings})

    def bind(self, model: Any, tokenizer: Any) -> None:
        self.model, self.tokenizer = model, tokenizer

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> list[list[Completion]]:
        """``n`` completions of each prompt, grouped by prompt in prompt order (``generate_batch`` returns its
        results in input order), sampled with ``generate``'s own settings for ``params``
        (:func:`~benchmarks.plain_generate.generate_settings`), stopping at ``params.stop_token_ids`` (the
        tokenizer's end-of-sequence token when empty)."""
        stop = list(params.stop_token_ids) or [self.tokenizer.eos_token_id]
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else stop[0]
        config = GenerationConfig(max_new_tokens=params.max_tokens, eos_token_id=stop, pad_token_id=pad,
                                  **generate_settings(params))
        inputs = [list(p) for p in prompts for _ in range(n)]
        out = list(self.model.generate_batch(inputs, generation_config=config,
                                             continuous_batching_config=self.settings, progress_bar=False).values())
        if len(out) != len(prompts) * n or any(o.error for o in out):
            failed = next((o.error for o in out if o.error), "missing results")
            raise RuntimeError(f"generate_batch returned {len(out)} of {len(prompts) * n} sequences: {failed}")
        completions = [Completion(list(o.generated_tokens), [], "stop" if o.generated_tokens and
                                  o.generated_tokens[-1] in stop else "length") for o in out]
        return [completions[i * n:(i + 1) * n] for i in range(len(prompts))]
