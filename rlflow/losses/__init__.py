"""Policy losses; each registers under the ``rlflow.losses`` entry-point group."""

from rlflow.losses.aggregation import AGGREGATIONS, aggregate
from rlflow.losses.base import LossContext, PolicyLoss, masked_mean
from rlflow.losses.cispo import CISPOLoss
from rlflow.losses.clipped import BNPOLoss, ClippedSurrogateLoss, DAPOLoss, DrGRPOLoss, GRPOLoss, GSPOLoss
from rlflow.losses.kl import KL_TYPES, kl_penalty
from rlflow.losses.sapo import SAPOLoss
from rlflow.losses.surrogate import RatioPolicyLoss

__all__ = [
    "PolicyLoss", "LossContext", "RatioPolicyLoss", "ClippedSurrogateLoss", "GRPOLoss", "BNPOLoss", "DrGRPOLoss",
    "DAPOLoss", "GSPOLoss", "CISPOLoss", "SAPOLoss", "kl_penalty", "KL_TYPES", "masked_mean", "aggregate",
    "AGGREGATIONS",
]
