"""Rollout/training mismatch correction: truncated and masked importance sampling (TIS / MIS).

The rollout engine (lmdeploy, a fused sampler, another precision) does not compute exactly the probabilities
the trainer computes, so even "on-policy" samples are slightly off-policy. With ``old_logprobs`` the trainer's
log-probs of the sampled tokens under the weights that sampled them and ``rollout_logprobs`` the engine's, the
ratio ``exp(old - rollout)`` per token (``token_*``) or ``exp(sum over the completion)`` per sequence
(``sequence_*``) re-weights the policy loss. ``*_truncate`` (TIS) caps the ratio at ``cap``; ``*_mask`` (MIS)
zeroes it where it exceeds ``cap`` (or falls below ``min_ratio`` when set). This is TRL's
``vllm_importance_sampling_*`` correction, with its metrics ``sampling/sampling_logp_difference/{mean,max}``
and ``sampling/importance_sampling_ratio/{min,mean,max}``.
"""

from __future__ import annotations

import torch

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


class RolloutCorrection:
    """Importance weights between the rollout engine's and the trainer's log-probs of the same tokens."""

    def __init__(self, mode: str = "token_truncate", cap: float = 2.0, min_ratio: float | None = None) -> None:
        """
        Args:
            mode: ``token_truncate`` / ``sequence_truncate`` (TIS) or ``token_mask`` / ``sequence_mask`` (MIS).
            cap: Upper bound of the ratio: truncated to it (TIS) or masked above it (MIS).
            min_ratio: MIS only: also mask ratios below this; None masks only from above (TRL).
        """
        if mode not in MODES:
            raise ValueError(f"unknown rollout correction mode {mode!r}; choose one of {', '.join(MODES)}")
        if cap <= 0:
            raise ValueError(f"the rollout correction cap must be > 0, got {cap}")
        if min_ratio is not None and not 0 <= min_ratio < cap:
            raise ValueError(f"min_ratio must be in [0, cap={cap}), got {min_ratio}")
        self.mode = mode
        self.cap = cap
        self.min_ratio = min_ratio

    @property
    def sequence_level(self) -> bool:
        return self.mode.startswith("sequence")

    def weights(self, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``[batch, tokens]`` (token modes) or ``[batch, 1]`` (sequence modes) weights, without gradient."""
        diff = (old_logprobs.detach().float() - rollout_logprobs.detach().float()) * mask.float()
        if self.sequence_level:
            diff = diff.sum(dim=-1, keepdim=True)
        ratio = torch.exp(diff.clamp(max=80.0))
        if self.mode.endswith("truncate"):
            return ratio.clamp(max=self.cap)
        keep = ratio <= self.cap
        if self.min_ratio is not None:
            keep &= ratio >= self.min_ratio
        return torch.where(keep, ratio, torch.zeros_like(ratio))

    def metrics(
        self, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, float]:
        """TRL's ``sampling/*`` metrics of one batch (0 where the batch has no completion token)."""
        mask = mask.bool()
        delta = (old_logprobs.float() - rollout_logprobs.float()).abs()[mask]
        w = self.weights(old_logprobs, rollout_logprobs, mask)
        flat = w.flatten() if self.sequence_level else w[mask]
        if delta.numel() == 0:
            return {key: 0.0 for key in _METRIC_NAMES}
        return {
            "sampling/sampling_logp_difference/mean": delta.mean().item(),
            "sampling/sampling_logp_difference/max": delta.max().item(),
            "sampling/importance_sampling_ratio/min": flat.min().item(),
            "sampling/importance_sampling_ratio/mean": flat.mean().item(),
            "sampling/importance_sampling_ratio/max": flat.max().item(),
        }


_METRIC_NAMES = (
    "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
)
