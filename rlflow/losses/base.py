"""The policy-loss contract, shared by built-in and plugin losses.

``loss(logprobs, old_logprobs, advantages, mask, ref_logprobs=None, rollout_logprobs=None, **extra)``
returns ``(loss, metrics)``. ``logprobs`` (with grad), ``old_logprobs``, ``ref_logprobs``,
``rollout_logprobs`` and ``mask`` are ``[batch, tokens]`` over completion tokens, ``advantages`` is
``[batch]``, ``metrics`` is a dict of floats with TRL's names (``clip_ratio/low_mean``, ``kl``...). The trainer
passes these keyword ``extra`` arguments; a plugin accepts and ignores what it does not use:

- ``entropy``: ``[batch, tokens]`` per-token entropy of the policy (with grad);
- ``truncated``: ``[batch]`` bool, completions cut at ``max_tokens``;
- ``rollout_is_weights``: ``[batch, tokens]`` or ``[batch, 1]`` rollout/training mismatch weights
  (:mod:`rlflow.training.correction`), to multiply the policy term by;
- ``ctx``: a :class:`LossContext` with the sizes of the batches this micro-batch belongs to.

The loss is computed on one micro-batch. How micro-batches add up to the mini-batch of one optimizer step is
the loss's own business (its normaliser): :meth:`PolicyLoss.micro_batch_weight` says by how much the trainer
scales each micro-batch's loss so that the accumulated gradient equals the gradient of the loss computed over
the whole mini-batch at once (and, under data parallelism, over every rank's mini-batch together: gradients
are averaged over ranks, so the weights carry a factor ``world_size``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossContext:
    """Sizes of the batches a micro-batch belongs to, summed over ranks, for normalisers that need them.

    Token counts are counted under the loss mask: a loss with ``mask_truncated_completions`` leaves truncated
    completions out of them.
    """

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

    #: ``token``: the micro-batch loss is a token mean; ``sequence``: a sequence mean (or a per-sequence
    #: constant normaliser); ``generation``: the loss is already normalised by a constant of the whole
    #: generation batch (DAPO), so micro-batches simply add up.
    unit: str = "token"
    #: Whether completions cut at ``max_tokens`` are left out of the loss (and of the token counts).
    mask_truncated_completions: bool = False

    def on_optimizer_step(self, reduce_sum=None) -> dict[str, float]:
        """Called after each optimizer step the trainer takes (``reduce_sum`` sums a tensor over ranks); a loss
        with state that follows training (adaptive entropy control) updates it here and returns metrics."""
        return {}

    def on_skipped_step(self) -> None:
        """Called instead when the trainer skips an optimizer step (a non-finite loss or gradient)."""

    def state_dict(self) -> dict:
        """The loss's training state, checkpointed with the module (empty for a stateless loss)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` from a checkpoint."""

    def zero_advantage_gradient(self) -> str | None:
        """None where a sequence whose advantage is 0 has exactly zero gradient under this loss (every token's term
        is its advantage times something finite); else why it may not. ``model.update.skip_zero_advantage`` leaves
        such sequences out of the backward pass and needs None. A plugin loss that scales every term by the
        advantage says so by overriding this."""
        return f"{type(self).__name__} does not declare that a zero advantage gives a zero gradient"

    def micro_batch_weight(self, mask: torch.Tensor, ctx: LossContext) -> float:
        """Factor for this micro-batch's loss so that micro-batches accumulate to the mini-batch loss.

        ``mask`` is the micro-batch's loss mask (truncated completions already removed where the loss masks
        them); ``ctx`` holds the mini-batch sizes summed over ranks.
        """
        world = max(int(ctx.world_size), 1)
        if self.unit == "generation":
            return 1.0
        if self.unit == "sequence":
            return mask.shape[0] * world / max(ctx.mini_batch_sequences, 1)
        if self.unit == "token":
            return float(mask.sum()) * world / max(ctx.mini_batch_tokens, 1)
        raise ValueError(f"{type(self).__name__}.unit must be 'token', 'sequence' or 'generation', got {self.unit!r}")

    def __call__(self, logprobs, old_logprobs, advantages, mask, ref_logprobs=None, rollout_logprobs=None, **extra):
        raise NotImplementedError
