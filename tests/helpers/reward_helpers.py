"""Reward functions written for ``trl.GRPOTrainer`` (TRL's signature and layout), used by the judger tests."""

from __future__ import annotations

import asyncio


def reward_len(completions, **kwargs):
    """TRL's documentation example, conversational layout: prefer completions of about 5 characters."""
    return [-abs(5 - len(completion[0]["content"])) / 10 for completion in completions]


def make_reward_contains(char: str):
    """A TRL-style reward factory: 1.0 when the completion contains ``char``."""

    def reward_contains(completions, **kwargs):
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        return [float(char in t) for t in texts]

    return reward_contains


async def async_reward_one(completions, **kwargs):
    """An ``async def`` TRL-style reward function."""
    await asyncio.sleep(0.01)
    return [1.0] * len(completions)


def solution_echo(completions, solution, **kwargs):
    """Reads TRL's ``solution`` column (filled by ``rename`` from XTuner's ``ground_truth``)."""
    return [float(s) for s in solution]
