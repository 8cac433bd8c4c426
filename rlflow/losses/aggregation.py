"""How a ``[batch, tokens]`` per-token loss becomes one number: the normalisers of grpo, bnpo, dr_grpo, dapo, luspo.

- ``grpo``: token mean within each sequence, then mean over sequences (the GRPO paper; TRL ``loss_type="grpo"``);
- ``bnpo``: one token mean over every completion token of the batch (TRL ``bnpo``, verl ``token-mean``);
- ``dr_grpo``: token sum divided by ``batch_size * max_tokens`` (Dr. GRPO: no length bias);
- ``dapo``: token sum divided by the number of completion tokens in the whole generation batch across ranks
  (DAPO's token-level loss; TRL ``dapo`` divides by ``num_items_in_batch / num_processes``, and so do we:
  the factor ``world_size`` undoes the gradient averaging over ranks);
- ``luspo``: token sum within each sequence, then mean over sequences (LUSPO: each sequence's loss scaled by its
  length; TRL ``luspo``).

Without a :class:`~rlflow.losses.base.LossContext` (a direct call on one batch), ``dapo`` treats the batch as
the whole generation batch on one rank, which makes it a token mean over the batch.
"""

from __future__ import annotations

import torch

from rlflow.losses.base import LossContext

#: Aggregation name -> the :attr:`PolicyLoss.unit` that makes micro-batches accumulate exactly.
UNITS = {"grpo": "sequence", "bnpo": "token", "dr_grpo": "sequence", "dapo": "generation", "luspo": "sequence"}
AGGREGATIONS = tuple(UNITS)


def check_aggregation(name: str) -> str:
    if name not in UNITS:
        raise ValueError(f"unknown loss aggregation {name!r}; choose one of {', '.join(AGGREGATIONS)}")
    return name


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    how: str,
    ctx: LossContext | None = None,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Reduce ``per_token`` (``[batch, tokens]``) over ``mask`` with the normaliser ``how``."""
    m = mask.to(per_token.dtype)
    total = (per_token * m).sum()
    if how == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if how == "bnpo":
        return total / m.sum().clamp(min=1.0)
    if how == "luspo":
        return (per_token * m).sum(-1).mean()
    if how == "dr_grpo":
        length = ctx.max_tokens if ctx is not None else max_tokens
        if not length:
            raise ValueError("the dr_grpo normaliser needs max_tokens (from the LossContext or the loss's max_tokens)")
        return total / (per_token.shape[0] * length)
    if how == "dapo":
        if ctx is None:
            return total / m.sum().clamp(min=1.0)
        return total * max(int(ctx.world_size), 1) / max(ctx.generation_batch_tokens, 1)
    check_aggregation(how)
    raise AssertionError("unreachable")
