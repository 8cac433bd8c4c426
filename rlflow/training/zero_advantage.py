"""Sequences that train nothing, left out of the backward pass (``model.update.skip_zero_advantage``).

A GRPO group whose completions all got the same reward gives each of them advantage 0. Under a loss whose every
token term is the advantage times something finite (the clipped surrogate and its normalisers, GSPO, LUSPO,
CISPO, SAPO, VESPO) with no KL term and no entropy bonus, such a sequence's gradient is exactly zero; so is a
truncated completion's where the loss masks truncated completions. With the option on, an optimizer step runs
those sequences through a forward pass without gradients only (its metrics: entropy, clip ratios, the rollout
correction's), and the others through the usual forward and backward passes. The loss's normalisers still count
every sequence (:class:`~rlflow.losses.base.LossContext` holds the whole mini-batch's sizes), so the update is
the one the full pass computes, up to float rounding: packs hold other sequences, so sums run in another order,
and metrics that are means of micro-batch means (``entropy``, ``clip_ratio/*``) are taken over other groupings.

When no sequence of a mini-batch would train, its shortest one still runs forward and backward: every parameter
then gets the zero gradient a full pass gives it, and the optimizer steps exactly as it would (momentum, weight
decay), not as it does for a parameter without a gradient.

Refused at startup, in one line, where such a sequence's gradient need not be zero: a KL term, an entropy bonus,
``top_entropy_quantile`` < 1, a loss that does not declare it (:meth:`~rlflow.losses.base.PolicyLoss.
zero_advantage_gradient`), a mixture-of-experts policy (its load-balancing loss has one, and its experts get a
gradient only from the sequences routed to them).

Under several processes (FSDP2) every forward and backward pass is a collective all ranks join, while each rank
leaves out its own sequences: every rank runs as many passes of each kind as the rank with the most, splitting its
own micro-batches further, then passes on one of its sequences whose loss is multiplied by 0.
"""

from __future__ import annotations

from typing import Any

from rlflow.config_error import ConfigError
from rlflow.data.experience import Experience
from rlflow.training.distributed import all_max, world_size
from rlflow.training.packing import balance_pack_count


def check_skip(loss_fn: Any, moe: bool) -> None:
    """ConfigError (one line) unless leaving zero-gradient sequences out keeps the update of this run (``moe``: the
    policy routes tokens to experts)."""
    reason = loss_fn.zero_advantage_gradient()
    if reason is None and moe:
        reason = ("the policy is a mixture of experts: its load-balancing loss has a gradient at any advantage, and "
                  "the experts that get a gradient depend on which sequences run")
    if reason is not None:
        raise ConfigError(f"model.update.skip_zero_advantage=true needs a zero gradient for every sequence it "
                          f"leaves out, but {reason}; set model.update.skip_zero_advantage=false")


def trains_nothing(experience: Experience, loss_fn: Any) -> bool:
    """Whether ``experience``'s gradient is zero: advantage 0, or truncated where the loss masks truncation."""
    return experience.advantage == 0.0 or (
        experience.truncated and getattr(loss_fn, "mask_truncated_completions", False))


def split_minibatch(minibatch: list[Experience], loss_fn: Any) -> tuple[list[Experience], list[Experience]]:
    """``(trained, forward_only)``: the sequences that go through the backward pass and those that do not, in
    their order; at least one trained (the shortest, where none would be)."""
    idle = [trains_nothing(e, loss_fn) for e in minibatch]
    if all(idle):
        keep = min(range(len(minibatch)), key=lambda i: len(minibatch[i].prompt_ids) + len(minibatch[i].completion_ids))
        idle[keep] = False
    trained = [e for e, skip in zip(minibatch, idle) if not skip]
    return trained, [e for e, skip in zip(minibatch, idle) if skip]


def skip_passes(module: Any, minibatch: list[Experience]) -> tuple[list, list]:
    """The micro-batches that go forward and backward and those that go forward only (``module.micro_batches`` of
    :func:`split_minibatch`'s two lists). Under several processes each pass is a collective every rank joins, so
    every rank gets as many passes of each kind as the rank with the most: its own split further where it has the
    sequences, then ``None``, a pass on one sequence that changes nothing."""
    trained, idle = split_minibatch(minibatch, module.loss_fn)
    passes = module.micro_batches(trained, balance=False)
    forward_only = module.micro_batches(idle, balance=False) if idle else []
    if world_size() > 1:
        passes = even_out(passes, all_max(len(passes)))
        forward_only = even_out(forward_only, all_max(len(forward_only)))
    return passes, forward_only


def even_out(passes: list[list[Experience]], count: int) -> list:
    """``passes`` split into ``count`` (as far as they have sequences), then ``None`` up to ``count``."""
    sequences = sum(len(p) for p in passes)
    if passes:
        passes = balance_pack_count(passes, min(count, sequences))
    return passes + [None] * (count - len(passes))
