"""Advantage estimators; each registers under the ``rlflow.advantages`` entry-point group."""

from rlflow.advantages.base import AdvantageEstimator, estimate
from rlflow.advantages.gdpo import GDPOAdvantage
from rlflow.advantages.grpo import DrGRPOAdvantage, GRPOAdvantage
from rlflow.advantages.opo import OPOAdvantage
from rlflow.advantages.reinforce_pp import ReinforcePPAdvantage
from rlflow.advantages.rloo import RLOOAdvantage

__all__ = [
    "AdvantageEstimator", "estimate", "GRPOAdvantage", "DrGRPOAdvantage", "RLOOAdvantage", "OPOAdvantage",
    "ReinforcePPAdvantage", "GDPOAdvantage",
]
