"""The advantage-estimator contract.

An estimator maps the rewards of a generation batch, laid out group after group (``k`` completions of one
prompt side by side), to one advantage per completion: ``estimator(rewards: Tensor[N], group_size: int,
lengths: Tensor[N] | None = None) -> Tensor[N]`` with ``N`` a multiple of ``group_size``. ``lengths`` (completion
tokens) is passed to estimators whose :attr:`AdvantageEstimator.needs_lengths` is true (OPO, REINFORCE++);
:func:`estimate` calls any estimator, plugin functions included, the right way.

Under data parallelism :func:`estimate_global` estimates over every rank's rewards (gathered in rank order) and
keeps this rank's slice, so batch-level statistics (``scale_rewards: batch``, REINFORCE++'s whitening) are the
global batch's; groups never span ranks, so group-level estimators need no gather but get the same answer.
"""

from __future__ import annotations

from typing import Any

import torch


class AdvantageEstimator:
    """Base class: checks the layout, then calls :meth:`compute` on a ``[groups, k]`` view."""

    #: Whether :meth:`compute` needs the completion lengths.
    needs_lengths: bool = False

    def __call__(self, rewards: torch.Tensor, group_size: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
        rewards = torch.as_tensor(rewards, dtype=torch.float32)
        if rewards.ndim != 1:
            raise ValueError(f"rewards must be 1-D, got shape {tuple(rewards.shape)}")
        if group_size < 1 or rewards.numel() % group_size:
            raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
        grouped_lengths = None
        if lengths is not None:
            lengths = torch.as_tensor(lengths, dtype=torch.float32).reshape(-1)
            if lengths.numel() != rewards.numel():
                raise ValueError(f"{lengths.numel()} lengths for {rewards.numel()} rewards")
            grouped_lengths = lengths.view(-1, group_size)
        elif self.needs_lengths:
            raise ValueError(f"the {type(self).__name__} advantage estimator needs the completion lengths")
        return self.compute(rewards.view(-1, group_size), grouped_lengths).reshape(-1)

    def compute(self, grouped: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


def estimate(
    estimator: Any, rewards: torch.Tensor, group_size: int, lengths: torch.Tensor | None = None,
    components: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Call ``estimator``, passing ``lengths`` only to estimators that ask for them (plugins may not take them),
    and ``components`` (each judger's rewards ``[N, judgers]``, NaN where none, and the judgers' weights) only to
    those with ``needs_components`` (GDPO)."""
    kwargs: dict[str, Any] = {}
    if getattr(estimator, "needs_lengths", False):
        kwargs["lengths"] = lengths
    if getattr(estimator, "needs_components", False):
        if components is None:
            raise ValueError(f"the {type(estimator).__name__} advantage estimator needs each judger's rewards")
        kwargs["components"], kwargs["weights"] = components
    return estimator(rewards, group_size, **kwargs)


def estimate_global(estimator: Any, rewards: torch.Tensor, group_size: int, lengths: torch.Tensor | None = None,
                    components: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """This rank's advantages, estimated over the generation batch of every rank (a collective under data
    parallelism: every rank calls it with the same number of rewards)."""
    from rlflow.training.distributed import all_gather, world_size

    if world_size() == 1:
        return estimate(estimator, rewards, group_size, lengths=lengths, components=components)
    n, rank = rewards.numel(), torch.distributed.get_rank()
    gathered_lengths = all_gather(lengths) if lengths is not None else None
    gathered_components = (all_gather(components[0]), components[1]) if components is not None else None
    everything = estimate(estimator, all_gather(rewards), group_size, lengths=gathered_lengths,
                          components=gathered_components)
    return everything[rank * n: (rank + 1) * n]
