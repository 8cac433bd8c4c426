"""The advantage-estimator contract.

An estimator maps the rewards of a generation batch, laid out group after group (``k`` completions of one
prompt side by side), to one advantage per completion: ``estimator(rewards: Tensor[N], group_size: int) ->
Tensor[N]`` with ``N`` a multiple of ``group_size``.
"""

from __future__ import annotations

import torch


class AdvantageEstimator:
    """Base class: checks the layout, then calls :meth:`compute` on a ``[groups, k]`` view."""

    def __call__(self, rewards: torch.Tensor, group_size: int) -> torch.Tensor:
        rewards = torch.as_tensor(rewards, dtype=torch.float32)
        if rewards.ndim != 1:
            raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
        if group_size < 1 or rewards.numel() % group_size:
            raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
        return self.compute(rewards.view(-1, group_size)).reshape(-1)

    def compute(self, grouped: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError
