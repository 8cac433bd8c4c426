"""The clipped surrogate objective of PPO/GRPO and the losses that differ from it only in their normaliser.

Per token, with ``r = exp(logprobs - old_logprobs)`` and advantage ``A``: ``-min(r * A, clip(r, 1 - epsilon_low,
1 + epsilon_high) * A)``. Options: ``delta`` caps the unclipped ratio from above (two-sided clipping of
INTELLECT-2, TRL's ``delta``); ``clip_ratio_c`` is the dual clip of verl/XTuner, which bounds the loss of a
negative-advantage token by ``-clip_ratio_c * A``. The losses registered here: ``grpo``, ``bnpo``, ``dr_grpo``,
``dapo`` (see :mod:`rlflow.losses.aggregation`), ``gspo`` (``grpo`` with ``importance_sampling_level:
sequence``) and ``luspo`` (GSPO's sequence ratio with each sequence's loss summed over its tokens, not averaged).
The metrics are TRL's ``clip_ratio/{low,high,region}_mean``, plus ``clip_ratio/dual_mean`` with a dual clip
(verl's ``pg_clipfrac_lower``).
"""

from __future__ import annotations

from typing import Any

import torch

from rlflow.config_error import ConfigError
from rlflow.losses.base import LossContext
from rlflow.losses.surrogate import RatioPolicyLoss


class ClippedSurrogateLoss(RatioPolicyLoss):
    """PPO's clipped surrogate with GRPO's options; subclasses only choose the default normaliser."""

    objective_scales_with_advantage = True

    def __init__(self, delta: float | None = None, clip_ratio_c: float | None = None, **kwargs: Any) -> None:
        """
        Args:
            delta: Cap on the unclipped ratio (two-sided clipping); must exceed ``1 + epsilon_high``. None disables it.
            clip_ratio_c: Dual clip: the loss of a negative-advantage token is at most ``-clip_ratio_c * A`` (verl
                uses 3.0); must exceed 1. None disables it.
            **kwargs: The options of :class:`~rlflow.losses.surrogate.RatioPolicyLoss` (``epsilon_low``,
                ``epsilon_high``, ``kl_coef``, ``kl_type``, ``importance_sampling_level``,
                ``mask_truncated_completions``, ``top_entropy_quantile``, ``entropy_coef``, ``max_tokens``,
                ``aggregation``).
        """
        super().__init__(**kwargs)
        if delta is not None and delta <= 1.0 + self.epsilon_high:
            raise ConfigError(f"delta must be greater than 1 + epsilon_high = {1.0 + self.epsilon_high}, got {delta}")
        if clip_ratio_c is not None and clip_ratio_c <= 1.0:
            raise ConfigError(f"clip_ratio_c (dual clip) must be greater than 1.0, got {clip_ratio_c}")
        self.delta = delta
        self.clip_ratio_c = clip_ratio_c

    def objective(self, coef, logprobs, adv, mask):
        clipped = torch.clamp(coef, 1.0 - self.epsilon_low, 1.0 + self.epsilon_high)
        unclipped = coef if self.delta is None else torch.clamp(coef, max=self.delta)
        per_token = -torch.min(unclipped * adv, clipped * adv)
        low = (coef < 1.0 - self.epsilon_low) & (adv < 0)
        high = (coef > 1.0 + self.epsilon_high) & (adv > 0)
        indicators = {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": low | high}
        if self.clip_ratio_c is not None:
            bound = -adv * self.clip_ratio_c
            indicators["clip_ratio/dual_mean"] = (per_token > bound) & (adv < 0)
            per_token = torch.where(adv < 0, torch.min(per_token, bound), per_token)
        return per_token, indicators


class GRPOLoss(ClippedSurrogateLoss):
    """``grpo``: token mean within each sequence, then mean over sequences (the GRPO paper)."""

    default_aggregation = "grpo"


class BNPOLoss(ClippedSurrogateLoss):
    """``bnpo``: one token mean over every completion token of the mini-batch (XTuner's default)."""

    default_aggregation = "bnpo"


class DrGRPOLoss(ClippedSurrogateLoss):
    """``dr_grpo``: token sum over ``batch_size * max_tokens``, free of GRPO's length bias (Dr. GRPO)."""

    default_aggregation = "dr_grpo"


class DAPOLoss(ClippedSurrogateLoss):
    """``dapo``: token sum over the completion tokens of the whole generation batch across ranks (DAPO)."""

    default_aggregation = "dapo"


class GSPOLoss(ClippedSurrogateLoss):
    """``gspo``: ``grpo`` with one importance ratio per sequence (Group Sequence Policy Optimization).

    The GSPO paper clips the sequence ratio at about ``3e-4``/``4e-4``: set ``epsilon_low``/``epsilon_high``.
    """

    default_aggregation = "grpo"

    def __init__(self, *args, importance_sampling_level: str = "sequence", **kwargs) -> None:
        super().__init__(*args, importance_sampling_level=importance_sampling_level, **kwargs)


class LUSPOLoss(GSPOLoss):
    """``luspo``: GSPO's one ratio per sequence, each sequence's loss summed over its tokens, then the mean over
    sequences (LUSPO: GSPO's per-sequence mean favours short completions; scaling by length removes that bias).
    The paper's setup is the sequence-level ratio, the default here; the clip range is GSPO's to set."""

    default_aggregation = "luspo"


__all__ = ["ClippedSurrogateLoss", "GRPOLoss", "BNPOLoss", "DrGRPOLoss", "DAPOLoss", "GSPOLoss", "LUSPOLoss",
           "LossContext"]

