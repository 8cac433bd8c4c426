"""An example rlflow environment: guess the number."""

from rlflow_env_guess.game import GuessNumber

__all__ = ["GuessNumber"]
