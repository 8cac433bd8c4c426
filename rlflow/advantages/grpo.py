"""GRPO's group-relative advantage ``(r - mean_group(r)) / (std + eps)``, and Dr. GRPO's ``r - mean_group(r)``.

``scale_rewards`` chooses the ``std``: ``group`` (the paper, the unbiased std of the group), ``batch`` (the std
of the whole generation batch, as in "Tricks or Traps"), or ``none`` (Dr. GRPO: no division). ``eps`` (1e-4,
TRL's) keeps groups whose rewards all agree at advantage 0 instead of dividing by zero.
"""

from __future__ import annotations

import torch

from rlflow.advantages.base import AdvantageEstimator


class GRPOAdvantage(AdvantageEstimator):
    """Group-relative advantages, GRPO's default estimator."""

    def __init__(self, scale_rewards: str = "group", eps: float = 1e-4) -> None:
        """
        Args:
            scale_rewards: Divide by the std of the ``group``, of the ``batch``, or not at all (``none``).
            eps: Added to the std before dividing.
        """
        if scale_rewards not in ("group", "batch", "none"):
            raise ValueError(f"scale_rewards must be 'group', 'batch' or 'none', got {scale_rewards!r}")
        self.scale_rewards = scale_rewards
        self.eps = eps

    def compute(self, grouped: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        centered = grouped - grouped.mean(dim=1, keepdim=True)
        if self.scale_rewards == "none":
            return centered
        if self.scale_rewards == "group":
            std = grouped.std(dim=1, keepdim=True) if grouped.shape[1] > 1 else torch.zeros_like(grouped[:, :1])
        else:
            std = grouped.std() if grouped.numel() > 1 else grouped.new_zeros(())
        return centered / (std + self.eps)


class DrGRPOAdvantage(GRPOAdvantage):
    """``dr_grpo``: the group mean is subtracted and nothing divided (Dr. GRPO removes the std's difficulty bias)."""

    def __init__(self) -> None:
        super().__init__(scale_rewards="none")
