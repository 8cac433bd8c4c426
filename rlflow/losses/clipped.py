"""The clipped surrogate objective of PPO/GRPO, with an optional KL penalty to a reference model.

Per token: ``ratio = exp(logprobs - old_logprobs)``, ``-min(ratio * A, clip(ratio, 1 - epsilon_low,
1 + epsilon_high) * A) + kl_coef * KL``. ``grpo`` averages tokens within each sequence and then sequences
(the GRPO paper); ``bnpo`` averages all completion tokens of the micro-batch together (XTuner's default).
"""

from __future__ import annotations

import torch

from rlflow.losses.base import LossContext, PolicyLoss, masked_mean
from rlflow.losses.kl import KL_TYPES, kl_penalty


class ClippedSurrogateLoss(PolicyLoss):
    """Shared body of the clipped-surrogate losses; subclasses choose the reduction."""

    def __init__(
        self,
        epsilon_low: float = 0.2,
        epsilon_high: float | None = None,
        kl_coef: float = 0.0,
        kl_type: str = "k3",
    ) -> None:
        if kl_type not in KL_TYPES:
            raise ValueError(f"unknown kl_type {kl_type!r}; choose one of {', '.join(KL_TYPES)}")
        self.epsilon_low = epsilon_low
        self.epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
        self.kl_coef = kl_coef
        self.kl_type = kl_type

    def reduce(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self, logprobs, old_logprobs, advantages, mask, ref_logprobs=None, rollout_logprobs=None, **extra):
        mask = mask.bool()
        adv = advantages.unsqueeze(1)
        ratio = torch.exp(logprobs - old_logprobs)
        clipped = torch.clamp(ratio, 1.0 - self.epsilon_low, 1.0 + self.epsilon_high)
        per_token = -torch.min(ratio * adv, clipped * adv)
        metrics: dict[str, float] = {}
        if self.kl_coef > 0.0:
            if ref_logprobs is None:
                raise ValueError("kl_coef > 0 needs ref_logprobs from a reference model")
            kl = kl_penalty(logprobs, ref_logprobs, self.kl_type)
            per_token = per_token + self.kl_coef * kl
            metrics["kl"] = masked_mean(kl.detach(), mask).item()
        low = (ratio < 1.0 - self.epsilon_low) & (adv < 0) & mask
        high = (ratio > 1.0 + self.epsilon_high) & (adv > 0) & mask
        n = mask.sum().clamp(min=1).item()
        metrics["clip_ratio/low_mean"] = low.sum().item() / n
        metrics["clip_ratio/high_mean"] = high.sum().item() / n
        metrics["clip_ratio/region_mean"] = (low | high).sum().item() / n
        loss = self.reduce(per_token, mask)
        return loss, metrics


class GRPOLoss(ClippedSurrogateLoss):
    """``grpo``: token mean within each sequence, then mean over sequences (the GRPO paper)."""

    unit = "sequence"

    def reduce(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return masked_mean(per_token, mask, dim=1).mean()


class BNPOLoss(ClippedSurrogateLoss):
    """``bnpo``: one token mean over every completion token of the micro-batch (XTuner's default)."""

    unit = "token"

    def reduce(self, per_token: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return masked_mean(per_token, mask)


__all__ = ["ClippedSurrogateLoss", "GRPOLoss", "BNPOLoss", "LossContext"]
