"""The environment contract: multi-turn tasks that are not tool calls (a game, a user simulator, a code checker).

An environment class registers in the ``rlflow.environments`` entry-point group (or is named by import path in
``data.multiturn.environment``) and subclasses :class:`Environment`. The multi-turn rollout
(:mod:`rlflow.rollout.multiturn`) builds **one instance per trajectory** with the configured ``init_args``, then:

1. ``reset(row)`` with the dataset row (``prompt`` as messages and every other column, ``ground_truth`` included)
   returns the first messages of the conversation, or None to keep the row's own prompt;
2. after every model turn, ``step(text)`` gets the text the model wrote in that turn (tool calls, if tools are
   configured too, are run before) and returns an :class:`EnvStep`: the next observation (messages appended to
   the conversation, usually one ``user`` message), an optional reward and whether the episode is done.

The trajectory ends when the environment says ``done``, when the model's turn produced neither a tool call nor an
observation, at ``data.multiturn.max_turns`` or at the ``data.sampling.max_tokens`` budget. Rewards returned by
``step`` are summed
into the sample's ``env_reward`` column, which the ``env_reward`` judger (``rlflow.judgers``) turns into a reward;
any other judger still scores the finished trajectory and sees the whole conversation as the completion.
Environments are plain synchronous objects (they run on the rollout's thread); an environment that raises ends
its trajectory, counted in ``env/failures``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EnvStep:
    """An environment's answer to one model turn."""

    observation: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    done: bool = False


class Environment:
    """Base class of environments: override :meth:`step` (and :meth:`reset` to write the first messages)."""

    def reset(self, row: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The first messages for dataset ``row``; None keeps the row's prompt."""
        return None

    def step(self, text: str) -> EnvStep:
        """React to the model's last turn (its text)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement step()")
