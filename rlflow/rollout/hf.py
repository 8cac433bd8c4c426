"""The ``hf`` rollout backend: sampling with transformers' ``model.generate`` on the live policy.

Colocated and copy-free: it generates with the very module the trainer optimises, so there are no weights to
sync. Prompts are left-padded into batches of at most ``batch_size`` sequences. Log-probs are taken from the
raw logits of each step divided by the temperature, one step at a time, so the ``[batch, steps, vocab]``
logits tensor is never built.

Sampling uses rlflow's per-row counter-based draws (:mod:`rlflow.rollout.draws`), not ``generate``'s own sampler:
:class:`RowDrawsSampler`, a transformers ``LogitsProcessor``, applies temperature, top-k and top-p as the engine's
:func:`~rlflow.rollout.sampling.sample_tokens` does, picks each row's token by inverse CDF from the row's own uniform
and leaves only that token possible, so ``generate`` runs greedy over it. Row ``s`` of prompt ``i`` draws from the
stream ``(call key, i, s)``, the call key being one draw from torch's global generator (or ``(seed, calls)`` with a
``seed``): what a row samples does not depend on which rows share its batch, so :meth:`HFRollout.serve` can batch
whichever multi-turn trajectories are ready (:meth:`rlflow.rollout.multiturn.MultiTurn.run_async`) and a seeded run
still samples the same tokens whatever the tools' timing. The behaviour log-probs are unchanged: ``log_softmax`` of
the raw logits over the temperature, before top-k/top-p, as the engine's.

Simplifications: every ``generate`` call re-prefills its rows' whole token ids (no cache is kept between a
trajectory's turns, unlike the engine's); a batch of ready trajectories runs to its longest row, so a trajectory
that is ready while a batch generates waits for the whole batch.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from rlflow.models.vision import generation_inputs, is_vision_model, placeholder_ids
from rlflow.rollout.base import Completion, Progress, RolloutBackend, SamplingParams
from rlflow.rollout.draws import CallKeys, RowDraws
from rlflow.rollout.penalty import mark_seen, penalize, seen_tokens
from rlflow.rollout.requests import DecodeRequest, ListSource, RequestSource
from rlflow.rollout.sampling import sample_tokens


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


class RowDrawsSampler(LogitsProcessor):
    """Samples each row's next token from its own random stream and leaves only that token possible (0 for it,
    ``-inf`` elsewhere), so ``generate``'s greedy choice takes it: seeded samples then depend on neither the batch
    composition nor torch's global generator. Temperature, top-k and top-p are applied here
    (:func:`rlflow.rollout.sampling.sample_tokens`), so ``generate`` must run with ``do_sample=False``."""

    def __init__(self, params: SamplingParams, draws: RowDraws | None, starts: list[int] | None = None) -> None:
        """
        Args:
            params: The sampling settings.
            draws: The rows' random streams; None samples greedily (a greedy call with a repetition penalty).
            starts: Where each row's prompt starts in ``input_ids`` (its left padding), for the repetition penalty.
        """
        self.params, self.draws, self.starts = params, draws, starts

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        uniform = None if self.draws is None else self.draws.draw(scores.device)
        tokens, _ = sample_tokens(scores, self.params, uniform=uniform, seen=self.seen(input_ids, scores.shape[-1]))
        only = torch.full_like(scores, float("-inf"))
        return only.scatter_(1, tokens.unsqueeze(1), 0.0)

    def seen(self, input_ids: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """The tokens of each row's prompt and completion so far, its padding left out (repetition penalty)."""
        if self.params.repetition_penalty == 1.0:
            return None
        starts = torch.tensor(self.starts or [0] * input_ids.shape[0], device=input_ids.device)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        return seen_tokens(input_ids, vocab, positions >= starts[:, None])


class HFRollout(CallKeys, RolloutBackend):
    """Generates with ``model.generate`` on the live policy weights (the embedded CPU default).

    Vision-language models: prompts with images (:class:`rlflow.models.vision.ImagePrompt`) are generated with their
    processed pixels, and the vision placeholder tokens are never sampled (``suppress_tokens``).
    """

    accepts_images = True

    def __init__(self, batch_size: int = 256, seed: int | None = None) -> None:
        """
        Args:
            batch_size: Most sequences per ``generate`` call (bounds the KV cache's memory).
            seed: Seed of the sampling draws (every row samples from its own counter-based stream keyed by the seed,
                the call count and the row, :mod:`rlflow.rollout.draws`); null: each call's key is one draw from
                torch's global generator.
        """
        self.batch_size = batch_size
        self.seed, self.calls = seed, 0

    def generation_config(self, params: SamplingParams, pad_id: int) -> GenerationConfig:
        """Greedy decoding over :class:`RowDrawsSampler`'s one possible token (sampling happens in the sampler)."""
        return GenerationConfig(
            do_sample=False,
            max_new_tokens=params.max_tokens,
            eos_token_id=list(params.stop_token_ids) or None,
            pad_token_id=pad_id,
            return_dict_in_generate=True,
            output_logits=True,
            use_cache=True,
        )

    def sampling_processors(self, params: SamplingParams, rows: list[tuple[DecodeRequest, int]],
                            config: GenerationConfig) -> LogitsProcessorList:
        """The processors that sample ``rows`` in a greedy ``generate`` call: :class:`RowDrawsSampler` over the rows'
        own streams (none when ``params`` is greedy)."""
        processors = LogitsProcessorList()
        width = max(len(r.ids) for r, _ in rows)
        starts = [width - len(r.ids) for r, _ in rows]  # left padding (left_pad)
        if not params.greedy:
            draws = RowDraws()
            draws.add([r.keys[s] for r, s in rows], [r.start for r, _ in rows])
            processors.append(RowDrawsSampler(params, draws, starts))
        elif params.repetition_penalty != 1.0:  # greedy over the penalised logits
            processors.append(RowDrawsSampler(params, None, starts))
        return processors

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], params: SamplingParams, n: int = 1, progress: Progress | None = None
    ) -> list[list[Completion]]:
        """``n`` completions per prompt; ``progress(completions, tokens)`` is called after each ``generate`` batch.
        Sample ``s`` of prompt ``i`` draws from the stream ``(call key, i, s)``."""
        requests = self.prompt_requests(prompts, params.greedy, n)
        groups: list[list[Completion]] = [[] for _ in prompts]
        for request, group in self.serve(ListSource(requests), params, progress):
            groups[request.tag] = group
        return groups

    @torch.no_grad()
    def serve(self, source: RequestSource, params: SamplingParams,
              progress: Progress | None = None) -> Iterator[tuple[DecodeRequest, list[Completion]]]:
        """Generate the requests ``source`` hands over (:mod:`rlflow.rollout.requests`): whenever ``generate`` is
        idle, every request that arrived is batched (``batch_size`` rows per call) and yielded as ``(request, its
        completions)`` once its rows are generated; the source is waited on only when nothing is queued. A request's
        row ``s`` samples from the stream ``keys[s]`` from counter ``start`` on, so it samples the same tokens in any
        batch (:class:`RowDrawsSampler`)."""
        model, tok = self.model, self.tokenizer
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        stop_ids = set(params.stop_token_ids)
        was_training = model.training
        model.eval()
        try:
            while True:
                requests = source.poll(wait=True)
                if requests is None:
                    return
                rows = [(r, s) for r in requests for s in range(r.n)]
                done: dict[int, list[Completion]] = {id(r): [] for r in requests}
                for start in range(0, len(rows), self.batch_size):
                    chunk = rows[start: start + self.batch_size]
                    outs = self._generate_rows(chunk, params, pad_id, stop_ids)
                    for (r, _), out in zip(chunk, outs):
                        done[id(r)].append(out)
                        if len(done[id(r)]) == r.n:
                            yield r, done[id(r)]
                    if progress is not None:
                        progress(len(outs), sum(len(c.token_ids) for c in outs))
        finally:
            model.train(was_training)

    def _generate_rows(self, rows: list[tuple[DecodeRequest, int]], params: SamplingParams, pad_id: int,
                       stop_ids: set[int]) -> list[Completion]:
        """One ``generate`` call over ``(request, sample index)`` rows; each row cut at its request's limit."""
        model = self.model
        device = next(model.parameters()).device
        limits = [r.limit(params.max_tokens) for r, _ in rows]
        chunk = [r.ids for r, _ in rows]
        config = self.generation_config(params, pad_id)
        config.max_new_tokens = max(limits)
        if is_vision_model(model):  # a sampled image placeholder would have no image to fill it in training
            config.suppress_tokens = placeholder_ids(model.config) or None
        processors = self.sampling_processors(params, rows, config)
        temperature = params.temperature if not params.greedy else 1.0
        ids, mask = left_pad(chunk, pad_id)
        vision = {k: v.to(device) for k, v in generation_inputs(model, chunk, ids).items()}
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=config,
                             logits_processor=processors, **vision)
        new = out.sequences[:, ids.shape[1]:]
        seen = None  # the repetition penalty's tokens per row, as the sampler saw them at each step
        if params.repetition_penalty != 1.0:
            seen = seen_tokens(ids.to(device), out.logits[0].shape[-1] if out.logits else 1, mask.bool().to(device))
        steps = []
        for t, logits in enumerate(out.logits):
            logits = logits.float() if seen is None else penalize(logits.float(), seen, params.repetition_penalty)
            steps.append(torch.log_softmax(logits / temperature, dim=-1).gather(1, new[:, t: t + 1]).squeeze(1))
            if seen is not None:
                mark_seen(seen, new[:, t])
        logprobs = torch.stack(steps, dim=1) if steps else new.new_zeros((new.shape[0], 0), dtype=torch.float)
        return [trim_at_stop(row, lp, stop_ids, limit)
                for row, lp, limit in zip(new.tolist(), logprobs.tolist(), limits)]
