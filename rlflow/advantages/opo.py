"""OPO (On-Policy RL with Optimal reward baseline): a length-weighted group baseline.

``A_i = r_i - sum_j(l_j r_j) / sum_j(l_j)`` over the completions ``j`` of the prompt, ``l`` their lengths in
tokens (Hao et al. 2025, verl's ``opo``): the baseline that minimises the variance of the sequence-level
gradient under the assumption that a gradient's norm grows with the completion's length.
"""

from __future__ import annotations

import torch

from rlflow.advantages.base import AdvantageEstimator


class OPOAdvantage(AdvantageEstimator):
    """Length-weighted mean reward of the group as the baseline."""

    needs_lengths = True

    def compute(self, grouped: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        assert lengths is not None
        total = lengths.sum(dim=1, keepdim=True)
        baseline = (lengths * grouped).sum(dim=1, keepdim=True) / total.clamp(min=1.0)
        # a group of empty completions has no length to weight by: fall back to the plain mean
        baseline = torch.where(total > 0, baseline, grouped.mean(dim=1, keepdim=True))
        return grouped - baseline
