"""SAPO (Soft Adaptive Policy Optimization): a smooth, temperature-controlled gate instead of the hard clip.

Per token: ``-f(r) * A`` with ``f(r) = sigmoid(tau * (r - 1)) * 4 / tau``, ``tau = tau_pos`` where ``A > 0``
and ``tau_neg`` elsewhere. ``f`` has slope 1 at ``r = 1`` (so on-policy it is the plain policy gradient) and
fades updates smoothly as the ratio moves away. Defaults follow the paper and TRL (``tau_pos`` 1.0,
``tau_neg`` 1.05, the ``grpo`` normaliser). ``epsilon_low``/``epsilon_high`` are accepted and unused.
"""

from __future__ import annotations

import torch

from rlflow.losses.surrogate import RatioPolicyLoss


class SAPOLoss(RatioPolicyLoss):
    """``sapo``: soft sigmoid gate on the importance ratio, sharper for negative advantages."""

    default_aggregation = "grpo"
    objective_scales_with_advantage = True

    def __init__(self, tau_pos: float = 1.0, tau_neg: float = 1.05, **kwargs) -> None:
        """
        Args:
            tau_pos: Gate temperature for tokens with a positive advantage (larger fades faster).
            tau_neg: Gate temperature for the other tokens; the paper recommends ``tau_neg > tau_pos``.
            **kwargs: The shared options of :class:`rlflow.losses.surrogate.RatioPolicyLoss` (``kl_coef``,
                ``importance_sampling_level``, ``mask_truncated_completions``, ``aggregation``...).
        """
        if tau_pos <= 0.0 or tau_neg <= 0.0:
            raise ValueError(f"tau_pos and tau_neg must be > 0, got {tau_pos} and {tau_neg}")
        super().__init__(**kwargs)
        self.tau_pos = tau_pos
        self.tau_neg = tau_neg

    def objective(self, coef, logprobs, adv, mask):
        tau = torch.where(adv > 0, torch.full_like(adv, self.tau_pos), torch.full_like(adv, self.tau_neg))
        gate = torch.sigmoid(tau * (coef - 1.0)) * 4.0 / tau
        return -gate * adv, {}
