"""Token sampling for the rollout backends: temperature, repetition penalty, top-k/top-p/min-p, inverse CDF.

:func:`sample_tokens` takes one token per row of a ``[rows, vocab]`` logits tensor from each row's own uniform
(the counter-based draws of :mod:`rlflow.rollout.draws`), so what a row samples does not depend on which rows share
its batch; the ``engine`` backend calls it every decode step and the ``hf`` backend's logits processor calls it from
inside ``generate``. It returns the log-probs of the taken tokens under the untruncated distribution
(``log_softmax(logits / temperature)``, after the repetition penalty), as
:class:`~rlflow.rollout.base.Completion` specifies.

Simplifications: one uniform per row and an inverse CDF in float64 (not ``torch.multinomial``'s one exponential per
vocabulary entry); truncation follows transformers' warpers in their order, each applied to the already truncated
distribution.
"""

from __future__ import annotations

import math

import torch

from rlflow.rollout.base import SamplingParams
from rlflow.rollout.buffers import VocabBuffers
from rlflow.rollout.penalty import penalize


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
    uniform: torch.Tensor | None = None, buffers: VocabBuffers | None = None, seen: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` (``[rows, vocab]``); return ``(tokens, logprobs)``.

    The log-probs are ``log_softmax(logits / temperature)`` of the taken tokens (temperature 1 when greedy),
    with the repetition penalty applied first to the tokens ``seen`` (``[rows, vocab]`` bool; ignored when the
    penalty is 1) and before top-k/top-p/min-p truncation; sampling itself draws from the truncated, renormalised
    distribution (top-k keeps ties with the k-th value; top-p keeps the smallest set of best tokens whose mass
    reaches ``top_p``; min-p then keeps the tokens of probability at least ``min_p`` times the best one's, as
    transformers' warpers do, in their order). ``uniform`` (``[rows]`` float64 in ``[0, 1)``, e.g. the engine's
    counter-based draws of :mod:`rlflow.rollout.draws`) gives each row's uniform; without it they are drawn from
    ``generator`` (torch's global one when None). ``buffers`` (the engine's, per serve call) holds the
    ``[rows, vocab]`` intermediates (:mod:`rlflow.rollout.buffers`: the same values, without allocating them anew
    every step).
    """
    if buffers is not None and logits.dtype != torch.float32:
        logits = buffers.get("logits", logits, torch.float32).copy_(logits)
    logits = logits.float()
    if seen is not None and params.repetition_penalty != 1.0:
        logits = penalize(logits, seen, params.repetition_penalty)
    temperature = params.temperature if not params.greedy else 1.0
    scaled = logits / temperature if temperature != 1.0 else logits
    if buffers is None:
        logp = torch.log_softmax(scaled, dim=-1)
    else:  # log_softmax's own kernel, into the buffer
        logp = torch.ops.aten._log_softmax.out(scaled, -1, False, out=buffers.get("logp", scaled))
    if params.greedy:
        tokens = logits.argmax(dim=-1)
    else:
        filtered = truncate(logp, params)
        # inverse-CDF sampling: one uniform per row (multinomial draws one exponential per vocabulary entry)
        probs = filtered.exp() if buffers is None else torch.exp(filtered, out=buffers.get("probs", filtered))
        if uniform is None:
            uniform = torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=torch.float64)
        else:
            uniform = uniform.to(device=probs.device, dtype=torch.float64).view(-1, 1)
        tokens = inverse_cdf(probs, uniform, buffers)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def truncate(logp: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``logp`` (``[rows, vocab]`` log-probs) with the tokens that top-k, top-p and min-p drop set to ``-inf``, in
    transformers' warper order: top-k keeps ties with the k-th value; top-p keeps the smallest set of best tokens
    whose mass (renormalised after top-k) reaches ``top_p``; min-p keeps the tokens whose probability is at least
    ``min_p`` times the best one's. ``logp`` itself where none applies."""
    filtered = logp
    if params.top_k and params.top_k < filtered.shape[-1]:
        kth = torch.topk(filtered, params.top_k, dim=-1).values[:, -1:]
        filtered = filtered.masked_fill(filtered < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_lp, order = torch.sort(filtered, dim=-1, descending=True)
        probs = sorted_lp.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the strictly better tokens
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= params.top_p)
        filtered = filtered.masked_fill(drop, float("-inf"))
    if params.min_p > 0.0:  # p < min_p * p_max, i.e. log p < log p_max + log min_p (normalisation cancels)
        floor = filtered.amax(dim=-1, keepdim=True) + math.log(params.min_p)
        filtered = filtered.masked_fill(filtered < floor, float("-inf"))
    return filtered


CDF_BLOCK = 256  # vocabulary entries per block of the two-level CDF


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor, buffers: VocabBuffers | None = None) -> torch.Tensor:
    """Per row of ``probs`` (``[rows, vocab]``, unnormalised, >= 0, some positive), the first index whose CDF (in
    float64, so that the tail of a large vocabulary keeps its mass) reaches ``u = (1 - uniform) * total``;
    ``uniform`` is ``[rows, 1]`` float64 in ``[0, 1)``, so ``u`` is in ``(0, total]`` and the index found has
    positive mass (a token of zero mass repeats the CDF before it).

    A vocabulary over ``4 * CDF_BLOCK`` entries takes two levels: float64 sums of blocks of :data:`CDF_BLOCK`
    entries, their cumulative sum (which block ``u`` falls in), then the cumulative sum of that one block, instead
    of a sequential float64 scan of the whole vocabulary (less time and memory traffic on a large vocabulary).
    The block sums add in another order than the scan, so a boundary of the CDF moves by float64 rounding
    (~1e-16 relative): the token differs from the whole scan's only when ``u`` lands within that distance of a
    boundary, or for ``uniform`` exactly 0 (``u`` the total, where tokens whose mass is below the total's last
    bit leave either CDF flat at different places): probabilities of ~1e-13 and 2**-53 per draw. Where rounding
    leaves ``u`` just past the chosen block's own scan, the block's last token of positive mass is taken.
    ``buffers`` holds the float64 copy of ``probs`` the block sums read (allocated per call without it).
    """
    rows, vocab = probs.shape
    if vocab <= 4 * CDF_BLOCK:
        cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
        return torch.searchsorted(cdf, (1.0 - uniform) * cdf[:, -1:]).squeeze(-1)
    block, full = CDF_BLOCK, vocab // CDF_BLOCK
    wide = probs.double() if buffers is None else buffers.get("probs64", probs, torch.float64).copy_(probs)
    sums = wide[:, : full * block].reshape(rows, full, block).sum(-1)
    if full * block < vocab:
        sums = torch.cat([sums, wide[:, full * block:].sum(-1, keepdim=True)], dim=1)
    cum = sums.cumsum_(-1)  # [rows, blocks]
    u = (1.0 - uniform) * cum[:, -1:]
    b = torch.searchsorted(cum, u).clamp_(max=cum.shape[1] - 1)  # the block u falls in (it has positive mass)
    start = cum.gather(1, (b - 1).clamp(min=0)).masked_fill_(b == 0, 0.0)  # the CDF before that block
    offsets = torch.arange(block, device=probs.device)
    cols = b * block + offsets  # [rows, block]
    mass = probs.gather(1, cols.clamp(max=vocab - 1)).masked_fill_(cols >= vocab, 0.0)
    inner = mass.to(torch.float64).cumsum_(-1).add_(start)
    j = torch.searchsorted(inner, u).clamp_(max=block - 1)
    last_positive = torch.where(mass > 0, offsets, -1).cummax(-1).values  # guard: j of zero mass -> the one before
    return (b * block + last_positive.gather(1, j)).squeeze(-1)
