"""Policy losses; each registers under the ``rlflow.losses`` entry-point group."""

from rlflow.losses.base import LossContext, PolicyLoss, masked_mean
from rlflow.losses.clipped import BNPOLoss, ClippedSurrogateLoss, GRPOLoss
from rlflow.losses.kl import kl_penalty

__all__ = ["PolicyLoss", "LossContext", "ClippedSurrogateLoss", "GRPOLoss", "BNPOLoss", "kl_penalty", "masked_mean"]
