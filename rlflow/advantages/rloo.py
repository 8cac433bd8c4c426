"""RLOO: each completion's baseline is the mean reward of the *other* completions of its prompt.

``A_i = r_i - mean_{j != i} r_j = k / (k - 1) * (r_i - mean_group(r))`` (Ahmadian et al. 2024, verl's
``rloo``). It is unbiased where GRPO's own-inclusive mean is not; it needs groups of at least 2.
"""

from __future__ import annotations

import torch

from rlflow.advantages.base import AdvantageEstimator


class RLOOAdvantage(AdvantageEstimator):
    """Leave-one-out baseline (REINFORCE Leave-One-Out)."""

    def compute(self, grouped: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        k = grouped.shape[1]
        if k < 2:
            raise ValueError("rloo needs at least 2 completions per prompt (data.prompt_repeat_k >= 2)")
        others = (grouped.sum(dim=1, keepdim=True) - grouped) / (k - 1)
        return grouped - others
