"""GDPO (Group reward-Decoupled normalization Policy Optimization): with several judgers, normalise each judger's
rewards within the group first, then sum them with their weights, then normalise the sum over the batch.

Why: GRPO sums the judgers' rewards before normalising, so a judger with a wide spread (a 0/1 correctness reward)
drowns one with a narrow spread (a 0.1-wide format reward), and groups whose summed rewards tie lose every
judger's signal. GDPO gives each judger its own group statistics (TRL's ``multi_objective_aggregation:
normalize_then_sum``, whose formula this follows): per judger ``(r - mean_group) / (std_group + eps)`` with the
unbiased std over the rewards it gave, ``nansum`` with ``data.judging.weights``, then ``(s - mean) / (std + eps)``
over the generation batch (every rank's). A judger that did not score a completion (another source's judger, or
one that failed) is left out of that completion's statistics; a completion no judger scored gets advantage 0.

Simplification: not combined with DAPO dynamic sampling (a config error), whose group filter reads the summed
reward.
"""

from __future__ import annotations

import torch

from rlflow.advantages.base import AdvantageEstimator


def nanstd(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """The unbiased standard deviation ignoring NaNs (NaN where fewer than two values remain)."""
    dims = dim if dim is not None else tuple(range(x.dim()))
    mean = torch.nanmean(x, dim=dims, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dims, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dims, keepdim=True) * count / (count - 1).clamp(min=1)
    std = torch.where(count > 1, var.sqrt(), torch.full_like(var, float("nan")))
    return std if keepdim else std.squeeze(dims)


class GDPOAdvantage(AdvantageEstimator):
    """``gdpo``: each judger's rewards normalised in its group, weighted, summed, then normalised over the batch."""

    #: :func:`rlflow.advantages.base.estimate` passes each judger's rewards (``components``, ``[N, judgers]`` with
    #: NaN where a judger gave none) and their weights.
    needs_components = True

    def __init__(self, eps: float = 1e-4) -> None:
        """
        Args:
            eps: Added to every std before dividing (TRL's 1e-4).
        """
        self.eps = eps

    def __call__(self, rewards: torch.Tensor, group_size: int, lengths: torch.Tensor | None = None,
                 components: torch.Tensor | None = None, weights: torch.Tensor | None = None) -> torch.Tensor:
        if components is None or weights is None:
            raise ValueError("the gdpo advantage estimator needs each judger's rewards (components) and weights")
        comp = torch.as_tensor(components, dtype=torch.float32)
        n, judgers = comp.shape
        if n % group_size:
            raise ValueError(f"{n} rewards do not split into groups of {group_size}")
        grouped = comp.view(-1, group_size, judgers)
        mean = torch.nanmean(grouped, dim=1, keepdim=True)
        std = nanstd(grouped, dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
        normed = ((grouped - mean) / (std + self.eps)).view(n, judgers)
        summed = (normed * torch.as_tensor(weights, dtype=torch.float32)).nansum(dim=1)
        summed[torch.isnan(comp).all(dim=1)] = float("nan")  # scored by no judger: no signal
        batch_std = nanstd(summed) if n > 1 else torch.zeros(())
        return torch.nan_to_num((summed - torch.nanmean(summed)) / (batch_std + self.eps), nan=0.0)
