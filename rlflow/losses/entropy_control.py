"""Adaptive entropy control (Skywork-OR1; TRL's ``use_adaptive_entropy``): an entropy bonus whose coefficient
follows the policy's entropy.

Why: a fixed entropy bonus either does nothing or, once the policy's entropy is healthy, keeps pushing it up;
entropy collapse is what it should prevent. The controller measures the entropy of the tokens the loss trains on
over each optimizer step (a token-weighted mean over its micro-batches and every rank), then moves the coefficient
by ``delta`` toward more bonus when that entropy is at or below ``target`` and toward less when above, within
``[coef_min, coef_max]``. The bonus of an optimizer step uses the coefficient from the end of the previous step,
and only when the entropy measured then was at or below ``target`` (none on the first step: nothing measured yet),
as in TRL. The state (coefficient and last entropy) is checkpointed with the module, so a resumed run continues
the same trajectory.

Simplification: a step skipped for a non-finite loss leaves the controller as it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rlflow.config_error import ConfigError


class AdaptiveEntropy:
    """The coefficient of the entropy bonus, updated once per optimizer step from the measured entropy."""

    def __init__(self, coef: float, target: float, coef_min: float, coef_max: float, delta: float) -> None:
        if not 0.0 <= coef_min <= coef <= coef_max:
            raise ConfigError(f"adaptive entropy needs 0 <= entropy_coef_min <= entropy_coef <= entropy_coef_max, got "
                              f"{coef_min}, {coef}, {coef_max}")
        if not delta > 0.0 or not target > 0.0:
            raise ConfigError(f"entropy_coef_delta and entropy_target must be > 0, got {delta} and {target}")
        self.coef, self.target, self.coef_min, self.coef_max, self.delta = coef, target, coef_min, coef_max, delta
        self.last_entropy = math.inf  # nothing measured yet: no bonus on the first step
        self._sum = self._count = 0.0

    def applied(self) -> float:
        """The coefficient this step's micro-batches use: the current one, if the last entropy was at or below
        the target; else 0."""
        return self.coef if self.last_entropy <= self.target else 0.0

    def observe(self, entropy: torch.Tensor, mask: torch.Tensor) -> None:
        """Add one micro-batch's entropies over the loss's tokens to this optimizer step's window."""
        m = mask.to(torch.float32)
        self._sum += float((entropy.detach().float() * m).sum())
        self._count += float(m.sum())

    def step(self, reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> float:
        """At an optimizer step: the window's entropy over every rank (``reduce_sum`` sums a tensor over ranks),
        the coefficient moved for the next step; returns the new coefficient."""
        totals = torch.tensor([self._sum, self._count], dtype=torch.float64)
        if reduce_sum is not None:
            totals = reduce_sum(totals)
        self.discard()
        entropy = float(totals[0]) / max(float(totals[1]), 1.0)
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_entropy = entropy
        return self.coef

    def discard(self) -> None:
        """Forget this step's window (a step that was skipped)."""
        self._sum = self._count = 0.0

    def state_dict(self) -> dict[str, float]:
        return {"entropy_coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.coef = float(state["entropy_coef"])
        self.last_entropy = float(state["last_entropy"])
