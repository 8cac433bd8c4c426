"""The repetition penalty (``data.sampling.repetition_penalty``; CTRL's, as transformers, vLLM and LMDeploy apply it).

A token that already occurs in the row (its prompt or its completion so far) has its logit divided by the penalty
when positive and multiplied by it when negative, before the temperature: a penalty above 1 makes repeats less
likely. The rollout backends apply it in their sampler, and the log-probs they return are those of the penalised
distribution at the temperature (vLLM's ``processed_logprobs``, which TRL asks for), so the rollout importance
correction (``model.rollout_correction.mode``) sees what the penalty changed; the trainer's own log-probs are the
policy's.

Simplification: "occurs" is presence over the prompt's and the completion's token ids (padding excluded), not a
count: repeated occurrences are penalised once, as everywhere.
"""

from __future__ import annotations

import torch


def seen_tokens(ids: torch.Tensor, vocab: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """``[rows, vocab]`` bool: which tokens occur in each row of ``ids`` (``[rows, width]``), counting only the
    positions where ``valid`` (same shape) is true (all when None). Ids outside the vocabulary are ignored."""
    inside = (ids >= 0) & (ids < vocab)
    if valid is not None:
        inside &= valid
    counts = torch.zeros((ids.shape[0], vocab), dtype=torch.int32, device=ids.device)
    counts.scatter_add_(1, ids.clamp(0, vocab - 1), inside.to(torch.int32))  # duplicates add, never overwrite
    return counts > 0


def mark_seen(seen: torch.Tensor, tokens: torch.Tensor) -> None:
    """Set ``seen[row, tokens[row]]`` for every row, in place (the tokens just sampled)."""
    seen[torch.arange(tokens.shape[0], device=tokens.device), tokens.clamp(0, seen.shape[1] - 1)] = True


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """``logits`` (float) with the tokens in ``seen`` penalised: ``/ penalty`` where positive, ``* penalty`` where
    not (transformers' ``RepetitionPenaltyLogitsProcessor``); a new tensor. ``seen`` may cover fewer columns than
    ``logits`` (a padded vocabulary: the extra columns were never seen)."""
    if seen.shape[1] < logits.shape[1]:
        seen = torch.nn.functional.pad(seen, (0, logits.shape[1] - seen.shape[1]))
    scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, scaled, logits)
