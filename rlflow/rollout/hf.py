"""The ``hf`` rollout backend: sampling with transformers' ``model.generate`` on the live policy.

Colocated and copy-free: it generates with the very module the trainer optimises, so there are no weights to
sync. Prompts are left-padded into batches of at most ``batch_size`` sequences. Log-probs are taken from the
raw logits of each step divided by the temperature, one step at a time, so the ``[batch, steps, vocab]``
logits tensor is never built.
"""

from __future__ import annotations

import torch
from transformers import GenerationConfig

from rlflow.rollout.base import Completion, Progress, RolloutBackend, SamplingParams
from rlflow.vision import generation_inputs, is_vision_model, placeholder_ids


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token-id lists into ``input_ids`` and ``attention_mask``."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
    return ids, mask


def trim_at_stop(tokens: list[int], logprobs: list[float], stop_ids: set[int], max_tokens: int) -> Completion:
    """Cut a generated row after its first stop token (kept), or at ``max_tokens``."""
    for j, tok in enumerate(tokens[:max_tokens]):
        if tok in stop_ids:
            return Completion(tokens[: j + 1], logprobs[: j + 1], "stop")
    return Completion(tokens[:max_tokens], logprobs[:max_tokens], "length")


class HFRollout(RolloutBackend):
    """Generates with ``model.generate`` on the live policy weights (the embedded CPU default).

    Vision-language models: prompts with images (:class:`rlflow.vision.ImagePrompt`) are generated with their
    processed pixels, and the vision placeholder tokens are never sampled (``suppress_tokens``).
    """

    accepts_images = True

    def __init__(self, batch_size: int = 256) -> None:
        """``batch_size``: most sequences per ``generate`` call (bounds the KV cache's memory)."""
        self.batch_size = batch_size

    def generation_config(self, params: SamplingParams, pad_id: int) -> GenerationConfig:
        return GenerationConfig(
            do_sample=not params.greedy,
            temperature=params.temperature if not params.greedy else None,
            top_p=params.top_p if not params.greedy else None,
            top_k=params.top_k if not params.greedy else None,
            max_new_tokens=params.max_tokens,
            eos_token_id=list(params.stop_token_ids) or None,
            pad_token_id=pad_id,
            return_dict_in_generate=True,
            output_logits=True,
            use_cache=True,
        )

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, n: int = 1, progress: Progress | None = None
    ) -> list[list[Completion]]:
        """``n`` completions per prompt; ``progress(completions, tokens)`` is called after each ``generate`` batch."""
        model, tok = self.model, self.tokenizer
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        stop_ids = set(params.stop_token_ids)
        expanded = [p for p in prompts for _ in range(n)]
        config = self.generation_config(params, pad_id)
        if is_vision_model(model):  # a sampled image placeholder would have no image to fill it in training
            config.suppress_tokens = placeholder_ids(model.config) or None
        temperature = params.temperature if not params.greedy else 1.0
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        flat: list[Completion] = []
        try:
            for start in range(0, len(expanded), self.batch_size):
                chunk = expanded[start: start + self.batch_size]
                ids, mask = left_pad(chunk, pad_id)
                vision = {k: v.to(device) for k, v in generation_inputs(model, chunk, ids).items()}
                out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                                     **vision)
                new = out.sequences[:, ids.shape[1]:]
                steps = [
                    torch.log_softmax(logits.float() / temperature, dim=-1).gather(1, new[:, t: t + 1]).squeeze(1)
                    for t, logits in enumerate(out.logits)
                ]
                logprobs = torch.stack(steps, dim=1) if steps else new.new_zeros((new.shape[0], 0), dtype=torch.float)
                done = [
                    trim_at_stop(row, lp, stop_ids, params.max_tokens)
                    for row, lp in zip(new.tolist(), logprobs.tolist())
                ]
                flat.extend(done)
                if progress is not None:
                    progress(len(done), sum(len(c.token_ids) for c in done))
        finally:
            model.train(was_training)
        return [flat[i * n: (i + 1) * n] for i in range(len(prompts))]
