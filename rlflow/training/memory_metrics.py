"""Peak memory of a rollout step, logged with its metrics.

* ``memory/max_allocated_gb`` and ``memory/max_reserved_gb`` (the policy on a CUDA device): the most memory
  torch's caching allocator held in tensors, and reserved from the device, during the step (the peaks are reset as
  the step starts): what decides an out-of-memory error. verl logs the same figures as
  ``perf/max_memory_allocated_gb`` and ``perf/max_memory_reserved_gb``.
* ``memory/max_rss_gb`` (every device): the trainer process's largest resident memory since it started
  (``getrusage``'s ``ru_maxrss``), which the host's out-of-memory killer watches. It never falls: a step that needs
  less than an earlier one leaves it where it was. Child processes (a pipelined run's generator, isolated judgers
  and tools) are not counted.

Across data-parallel ranks each takes the largest rank's figure (:func:`rlflow.training.distributed.combine_metrics`
takes the maximum of names with a ``max`` part). GiB: 2**30 bytes.
"""

from __future__ import annotations

import resource
import sys

import torch

GIB = 2 ** 30


def reset_peaks(device: torch.device) -> None:
    """Start the step's CUDA peaks afresh (nothing to do elsewhere)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_rss_bytes() -> int:
    """The process's largest resident set so far, in bytes (``ru_maxrss`` is in KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def memory_metrics(device: torch.device) -> dict[str, float]:
    """The step's memory figures for ``device`` (the policy's), in GiB."""
    out = {"memory/max_rss_gb": peak_rss_bytes() / GIB}
    if device.type == "cuda":
        out["memory/max_allocated_gb"] = torch.cuda.max_memory_allocated(device) / GIB
        out["memory/max_reserved_gb"] = torch.cuda.max_memory_reserved(device) / GIB
    return out
