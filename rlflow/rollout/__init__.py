"""Rollout backends generate completions; each registers under the ``rlflow.rollout`` entry-point group."""

from rlflow.rollout.base import Completion, RolloutBackend, SamplingParams, UnsupportedModelError

__all__ = ["Completion", "RolloutBackend", "SamplingParams", "UnsupportedModelError"]
