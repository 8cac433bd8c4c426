"""Guess the number: the model guesses a secret integer and is told "higher" or "lower" after each wrong guess.

The secret is the row's ``ground_truth`` column (XTuner rows carry it as ``reward_model.ground_truth``). The first
messages ask for a guess between ``low`` and ``high``; after every model turn the last integer in its text is the
guess. A right guess ends the episode with reward 1 (minus ``turn_penalty`` per earlier wrong guess); a wrong one
gets the hint as the next user message and reward 0; a turn without a number gets a reminder. Score it with the
built-in ``env_reward`` judger.
"""

from __future__ import annotations

import re
from typing import Any

from rlflow.environments import Environment, EnvStep

_INT = re.compile(r"-?\d+")


class GuessNumber(Environment):
    """One game of guess-the-number per trajectory.

    Args:
        low: Smallest possible secret (shown to the model).
        high: Largest possible secret (shown to the model).
        turn_penalty: Reward taken off a right guess for each wrong guess before it.
    """

    def __init__(self, low: int = -20, high: int = 20, turn_penalty: float = 0.0) -> None:
        self.low, self.high, self.turn_penalty = low, high, turn_penalty
        self.secret: int | None = None
        self.wrong = 0

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        try:
            self.secret = int(str(row["ground_truth"]).strip())
        except (KeyError, ValueError) as exc:
            raise ValueError(f"guess_number needs an integer ground_truth column, got {row.get('ground_truth')!r}") \
                from exc
        self.wrong = 0
        return [{"role": "user", "content": f"Guess my number between {self.low} and {self.high}. "
                                            "Answer with one number."}]

    def step(self, text: str) -> EnvStep:
        found = _INT.findall(text)
        if not found:
            return EnvStep([{"role": "user", "content": "Answer with one number."}], reward=0.0)
        guess = int(found[-1])
        if guess == self.secret:
            return EnvStep([], reward=max(0.0, 1.0 - self.turn_penalty * self.wrong), done=True)
        self.wrong += 1
        hint = "higher" if guess < self.secret else "lower"
        return EnvStep([{"role": "user", "content": f"{guess} is wrong: my number is {hint}."}], reward=0.0)
