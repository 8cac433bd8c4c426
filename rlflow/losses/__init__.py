"""Policy losses; each registers under the ``rlflow.losses`` entry-point group."""

from rlflow.losses.aggregation import AGGREGATIONS, aggregate
from rlflow.losses.base import LossContext, PolicyLoss, masked_mean
from rlflow.losses.cispo import CISPOLoss
from rlflow.losses.clipped import BNPOLoss, ClippedSurrogateLoss, DAPOLoss, DrGRPOLoss, GRPOLoss, GSPOLoss, LUSPOLoss
from rlflow.losses.kl import KL_TYPES, kl_penalty
from rlflow.losses.sapo import SAPOLoss
from rlflow.losses.surrogate import RatioPolicyLoss
from rlflow.losses.vespo import VESPOLoss

__all__ = [
    "PolicyLoss", "LossContext", "RatioPolicyLoss", "ClippedSurrogateLoss", "GRPOLoss", "BNPOLoss", "DrGRPOLoss",
    "DAPOLoss", "GSPOLoss", "LUSPOLoss", "CISPOLoss", "SAPOLoss", "VESPOLoss", "kl_penalty", "KL_TYPES", "masked_mean",
    "aggregate", "AGGREGATIONS",
]
