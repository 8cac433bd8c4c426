"""FSDP2 units of a model, and its full weights for a block of forward passes: torch only.

Generation needs both (:func:`full_weights` around a rollout of a sharded policy; :func:`fsdp_modules` to choose the
decoding mode), and generation also runs in processes that never train (the generator process of
:mod:`rlflow.rollout.process`): they import this module, not :mod:`rlflow.training.distributed` and its Lightning
strategies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def fsdp_modules(model: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def full_weights(model: torch.nn.Module | None) -> Iterator[None]:
    """Unshard every FSDP unit of ``model`` for the block (generation), reshard after; a no-op on a plain model.

    Inside, forward passes run no collectives, so ranks may generate different numbers of steps.
    """
    modules = fsdp_modules(model) if model is not None else []
    if not modules:
        yield
        return
    root_state = getattr(model, "_get_fsdp_state", lambda: None)()
    if root_state is not None and hasattr(root_state, "_lazy_init"):
        root_state._lazy_init()  # FSDP2 makes the first unit to run forward the root: make sure it is this one
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
    try:
        for m in modules:
            m.unshard()
        yield
    finally:
        for m in modules:
            m.reshard()
        layer_flag = model.__dict__.get("_rlflow_reshard_after_forward", True)
        for m in modules:  # the root keeps its unsharded weights between forward and backward, as FSDP2 sets it
            m.set_reshard_after_forward(layer_flag if m is not model else False, recurse=False)
