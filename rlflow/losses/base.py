"""The policy-loss contract, shared by built-in and plugin losses.

``loss(logprobs, old_logprobs, advantages, mask, ref_logprobs=None, rollout_logprobs=None, **extra)``
returns ``(loss, metrics)``. ``logprobs`` (with grad), ``old_logprobs``, ``ref_logprobs``,
``rollout_logprobs`` and ``mask`` are ``[batch, tokens]`` over completion tokens, ``advantages`` is
``[batch]``, ``metrics`` is a dict of floats with TRL's names. ``extra`` may carry ``entropy`` (``[batch,
tokens]``) and ``ctx`` (a :class:`LossContext`); a plugin should accept and ignore what it does not use.

The loss is computed on one micro-batch. How micro-batches add up to the mini-batch of one optimizer step is
the loss's own business (its normaliser): :meth:`PolicyLoss.micro_batch_weight` says by how much the trainer
scales each micro-batch's loss so that the accumulated gradient equals the full mini-batch's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossContext:
    """Sizes of the batches a micro-batch belongs to, summed over ranks, for normalisers that need them."""

    mini_batch_sequences: int
    mini_batch_tokens: int
    generation_batch_sequences: int
    generation_batch_tokens: int
    max_tokens: int
    world_size: int = 1


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is true (0 where nothing is masked in)."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1.0)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1.0)


class PolicyLoss:
    """Base class of policy losses; subclasses implement ``__call__`` and say how micro-batches are weighted."""

    #: ``token``: the micro-batch loss is a token mean; ``sequence``: a sequence mean.
    unit: str = "token"

    def micro_batch_weight(self, mask: torch.Tensor, ctx: LossContext) -> float:
        """Factor for this micro-batch's loss so that micro-batches accumulate to the mini-batch loss."""
        if self.unit == "sequence":
            return mask.shape[0] / max(ctx.mini_batch_sequences, 1)
        return float(mask.sum()) / max(ctx.mini_batch_tokens, 1)

    def __call__(self, logprobs, old_logprobs, advantages, mask, ref_logprobs=None, rollout_logprobs=None, **extra):
        raise NotImplementedError
