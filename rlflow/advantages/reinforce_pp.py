"""REINFORCE++: outcome rewards whitened over every completion token of the batch.

With one reward per completion and no discount, each token's return is the completion's reward; REINFORCE++
whitens those returns over all tokens of the batch: ``(x - mean) / sqrt(var + 1e-8)`` with token-weighted
``mean`` and the unbiased token ``var`` (verl's ``masked_whiten``). With ``group_baseline`` the group mean is
first subtracted (verl's ``reinforce_plus_plus_baseline``). The KL-in-reward of the paper is left to the loss's
``kl_coef``.
"""

from __future__ import annotations

import torch

from rlflow.advantages.base import AdvantageEstimator


class ReinforcePPAdvantage(AdvantageEstimator):
    """Batch-whitened outcome advantages (REINFORCE++), optionally after a group-mean baseline."""

    needs_lengths = True

    def __init__(self, group_baseline: bool = False) -> None:
        """
        Args:
            group_baseline: Subtract each prompt's mean reward before whitening (REINFORCE++-baseline).
        """
        self.group_baseline = group_baseline

    def compute(self, grouped: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        assert lengths is not None
        x = grouped - grouped.mean(dim=1, keepdim=True) if self.group_baseline else grouped
        w = lengths.double()
        n = w.sum()
        if n < 2:
            raise ValueError(f"reinforce_pp whitens over the batch's tokens and needs at least 2, got {int(n)}")
        xd = x.double()
        mean = (w * xd).sum() / n
        var = (w * (xd - mean) ** 2).sum() / n * (n / (n - 1))
        return ((xd - mean) * torch.rsqrt(var + 1e-8)).to(grouped.dtype)
