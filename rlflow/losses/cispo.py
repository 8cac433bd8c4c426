"""CISPO (MiniMax-M1): clip the importance-sampling weight, not the update, so every token keeps a gradient.

Per token: ``-sg(min(r, 1 + epsilon_high)) * A * logprobs`` with ``sg`` stop-gradient, a REINFORCE-style
objective whose weight is the truncated ratio. The paper writes the weight as ``clip(r, 1 - eps_low, 1 +
eps_high)`` and drops the lower bound in practice, as here. TRL's ``epsilon_high`` for CISPO is the cap itself
(its recommended 5.0 is ``epsilon_high: 4.0`` here). The default normaliser is ``dapo``, as in TRL. Metric:
TRL's ``cispo_clip_ratio``.
"""

from __future__ import annotations

import torch

from rlflow.losses.surrogate import RatioPolicyLoss


class CISPOLoss(RatioPolicyLoss):
    """``cispo``: REINFORCE weighted by the stop-gradient ratio truncated at ``1 + epsilon_high``."""

    default_aggregation = "dapo"
    objective_scales_with_advantage = True

    def objective(self, coef, logprobs, adv, mask):
        cap = 1.0 + self.epsilon_high
        weight = torch.clamp(coef, max=cap).detach()
        per_token = -weight * adv * logprobs
        return per_token, {"cispo_clip_ratio": (coef > cap) & (adv > 0)}
