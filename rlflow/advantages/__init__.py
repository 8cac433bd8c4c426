"""Advantage estimators; each registers under the ``rlflow.advantages`` entry-point group."""

from rlflow.advantages.base import AdvantageEstimator
from rlflow.advantages.grpo import GRPOAdvantage

__all__ = ["AdvantageEstimator", "GRPOAdvantage"]
