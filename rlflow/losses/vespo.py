"""VESPO (Variational Sequence-Level Soft Policy Optimization): a smooth Gamma-shaped weight on the sequence
importance ratio instead of a hard clip.

Per completion, with ``w = exp(sum over its tokens of (logprobs - old_logprobs))`` (a sum, not GSPO's mean) and
the rollout/training mismatch weights folded in as ``+ sum log(is_weight)``: ``phi(w) = exp(lambda + k * log w -
lambda * w)``, which is 1 at ``w = 1``, vanishes as ``w -> 0`` (power ``k``) and as ``w -> inf`` (decay
``lambda``). ``(k, lambda)`` are ``(k_pos, lambda_pos)`` for a non-negative advantage and ``(k_neg, lambda_neg)``
otherwise. Per token: ``-sg(phi) * A * logprobs`` (``sg``: stop-gradient), so the gradient is REINFORCE scaled by
``phi``. ``log w`` is clamped to ``[log 1e-8, 20]`` and each log IS weight likewise, as TRL does; the default
normaliser is ``dapo``, as in TRL. Metric: TRL's ``vespo/phi_seq_mean``.

Simplifications: the ratio is always built from token log-ratios (``importance_sampling_level: token``; the
sequence level is refused, since it would change nothing), and a rollout correction must be token-level
(``token_truncate``/``token_mask``), as TRL requires.
"""

from __future__ import annotations

import math

import torch

from rlflow.config_error import ConfigError
from rlflow.losses.surrogate import RatioPolicyLoss

LOG_MIN = math.log(1e-8)  # lower clamp of log w and of each log IS weight (TRL)


class VESPOLoss(RatioPolicyLoss):
    """``vespo``: REINFORCE weighted by a stop-gradient Gamma function of the sequence importance ratio."""

    default_aggregation = "dapo"
    objective_scales_with_advantage = True
    own_importance_weights = True

    def __init__(self, k_pos: float = 2.0, lambda_pos: float = 3.0, k_neg: float = 3.0, lambda_neg: float = 2.0,
                 **kwargs) -> None:
        """
        Args:
            k_pos: Power of ``w`` for a non-negative advantage: how fast sequences with ``w < 1`` are down-weighted.
            lambda_pos: Decay for a non-negative advantage: how fast sequences with ``w > 1`` are down-weighted.
            k_neg: Power of ``w`` for a negative advantage.
            lambda_neg: Decay for a negative advantage.
            **kwargs: The shared options of :class:`rlflow.losses.surrogate.RatioPolicyLoss` (``kl_coef``,
                ``mask_truncated_completions``, ``off_policy_mask_threshold``, ``aggregation``...);
                ``epsilon_low``/``epsilon_high`` are accepted and unused.
        """
        if kwargs.get("importance_sampling_level", "token") != "token":
            raise ConfigError("vespo builds its sequence weight from token log-ratios itself: "
                              "importance_sampling_level must be 'token'")
        if min(k_pos, k_neg) < 0.0 or min(lambda_pos, lambda_neg) <= 0.0:
            raise ConfigError(f"vespo needs k >= 0 and lambda > 0, got k_pos={k_pos}, lambda_pos={lambda_pos}, "
                              f"k_neg={k_neg}, lambda_neg={lambda_neg}")
        super().__init__(**kwargs)
        self.k_pos, self.lambda_pos, self.k_neg, self.lambda_neg = k_pos, lambda_pos, k_neg, lambda_neg

    def objective(self, coef, logprobs, adv, mask, log_ratio=None, rollout_is_weights=None):
        with torch.no_grad():
            m = mask.to(logprobs.dtype)
            log_w = (log_ratio * m).sum(-1, keepdim=True)  # already clamped to [-20, 20] per token
            if rollout_is_weights is not None:
                if rollout_is_weights.shape[-1] == 1 and mask.shape[-1] != 1:
                    raise ConfigError(
                        "vespo folds token-level rollout correction weights: set model.rollout_correction.mode to "
                        "token_truncate or token_mask, not a sequence mode"
                    )
                log_is = torch.log(rollout_is_weights.to(logprobs.dtype)).clamp(LOG_MIN, 20.0)
                log_w = log_w + (log_is * m).sum(-1, keepdim=True)
            log_w = log_w.clamp(LOG_MIN, 20.0)
            positive = adv >= 0
            k = torch.where(positive, self.k_pos, self.k_neg)
            lam = torch.where(positive, self.lambda_pos, self.lambda_neg)
            phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        return -phi * adv * logprobs, {"vespo/phi_seq_mean": phi}
