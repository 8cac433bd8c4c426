"""Reused ``[rows, vocabulary]`` buffers for the engine's sampler (:func:`rlflow.rollout.sampling.sample_tokens`).

Why: every decode step turns the logits into float32 logits (of a 16-bit head), log-probs, probabilities and
their float64 copy (:func:`~rlflow.rollout.sampling.inverse_cdf`), each a fresh ``[rows, vocabulary]`` tensor (~6-13
MB at 32 rows of a 49k vocabulary). Blocks that large come from the C allocator's ``mmap``, so every step
page-faults them in and unmaps them again, a noticeable part of a small model's decode step. Writing the same
kernels' results into buffers kept for the rollout call (``out=`` / in-place forms) gives bit-identical values
without the churn.

Simplifications: one buffer per name, grown to the largest ``rows x vocabulary`` asked for and viewed to the
size asked for (rows leave a decode batch, so later steps take a prefix); held as long as the object (the
engine keeps one per serve call).
"""

from __future__ import annotations

import torch


class VocabBuffers:
    """Named flat buffers handed out as ``[rows, vocab]`` views (see the module docstring)."""

    def __init__(self) -> None:
        self._flat: dict[str, torch.Tensor] = {}

    def get(self, name: str, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An uninitialised tensor of ``like``'s shape and device in ``dtype`` (None: ``like``'s), backed by the
        buffer ``name`` (the same memory on every call with that name: use one name per live value)."""
        dtype = dtype or like.dtype
        flat = self._flat.get(name)
        if flat is None or flat.numel() < like.numel() or flat.dtype != dtype or flat.device != like.device:
            flat = self._flat[name] = torch.empty(like.numel(), dtype=dtype, device=like.device)
        return flat[: like.numel()].view(like.shape)
