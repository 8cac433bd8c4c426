"""Multi-turn environments (the ``rlflow.environments`` entry-point group); see :mod:`rlflow.environments.base`."""

from rlflow.environments.base import Environment, EnvStep

__all__ = ["Environment", "EnvStep"]
