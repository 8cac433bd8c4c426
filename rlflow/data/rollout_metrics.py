"""The metrics of one rollout step, under TRL's names where TRL has the concept.

``reward``, ``reward_std`` (the mean over groups of the within-group standard deviation, as TRL logs it),
``frac_reward_zero_std``, ``completions/mean_length``, ``min_length``, ``max_length``, ``clipped_ratio`` (share
that hit ``max_tokens``), ``mean_terminated_length``, plus rlflow's ``rollout/time`` and ``rollout/tokens_per_s``
and the prompt/completion token counts that the module sums into TRL's cumulative ``num_tokens``. Lengths count the
tokens the model sampled (a multi-turn completion's tool and environment tokens are not completion length).
"""

from __future__ import annotations

from typing import Any

import torch


def rollout_metrics(rewards: torch.Tensor, completions: list[Any], k: int, prompt_tokens: int, gen_time: float,
                    ) -> dict[str, float]:
    """Metrics of ``rewards`` (``k`` per group, in group order) and their ``completions``."""
    lengths = torch.tensor([c.num_sampled for c in completions], dtype=torch.float32)
    group_std = rewards.view(-1, k).std(dim=1)
    terminated = [c.num_sampled for c in completions if c.finish_reason == "stop"]
    return {
        "reward": rewards.mean().item(),
        "reward_std": group_std.mean().item(),
        "frac_reward_zero_std": torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item(),
        "completions/mean_length": lengths.mean().item(),
        "completions/min_length": lengths.min().item(),
        "completions/max_length": lengths.max().item(),
        "completions/clipped_ratio": sum(c.finish_reason == "length" for c in completions) / len(completions),
        "completions/mean_terminated_length": sum(terminated) / len(terminated) if terminated else 0.0,
        "rollout/time": gen_time,
        "rollout/tokens_per_s": lengths.sum().item() / max(gen_time, 1e-9),
        "num_prompt_tokens": float(prompt_tokens),
        "num_completion_tokens": lengths.sum().item(),
    }
