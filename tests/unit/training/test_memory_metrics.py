"""The step's memory metrics: the process's peak resident memory against the kernel's own count, the CUDA peaks,
and the largest rank's figure under data parallelism."""

from __future__ import annotations

import pytest
import torch

from rlflow.training.distributed import combine_metrics
from rlflow.training.memory_metrics import GIB, memory_metrics, reset_peaks


def proc_status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (``VmHWM``: the kernel's peak resident set; ``VmRSS``: now), in bytes."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    pytest.skip(f"no {field} in /proc/self/status")


def test_peak_rss_follows_the_kernels_count_and_grows_with_touched_memory():
    before = memory_metrics(torch.device("cpu"))
    assert set(before) == {"memory/max_rss_gb"}
    assert before["memory/max_rss_gb"] == pytest.approx(proc_status_bytes("VmHWM") / GIB, rel=0.02)
    # touch enough fresh memory to pass the old peak by 64 MiB
    grow = proc_status_bytes("VmHWM") - proc_status_bytes("VmRSS") + 64 * 2 ** 20
    block = torch.ones(grow // 4, dtype=torch.float32)
    after = memory_metrics(torch.device("cpu"))["memory/max_rss_gb"]
    del block
    assert after - before["memory/max_rss_gb"] >= 48 / 1024
    assert after == pytest.approx(proc_status_bytes("VmHWM") / GIB, rel=0.02)
    assert memory_metrics(torch.device("cpu"))["memory/max_rss_gb"] == after  # a peak: freeing does not lower it


def test_ranks_report_the_largest_rank_figure():
    ranks = [{"memory/max_rss_gb": 3.0, "memory/max_allocated_gb": 10.0, "memory/max_reserved_gb": 12.0, "reward": 1.0},
             {"memory/max_rss_gb": 5.0, "memory/max_allocated_gb": 7.0, "memory/max_reserved_gb": 13.0, "reward": 0.0}]
    got = combine_metrics(ranks, samples_per_rank=4)
    names = ("memory/max_rss_gb", "memory/max_allocated_gb", "memory/max_reserved_gb")
    assert [got[name] for name in names] == [5.0, 10.0, 13.0]
    assert got["reward"] == 0.5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_peaks_are_the_steps_own():
    device = torch.device("cuda")
    big = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device=device)
    del big
    reset_peaks(device)
    held = torch.cuda.memory_allocated(device) / 2 ** 30  # what earlier tests of this process still hold
    small = torch.empty(16 * 2 ** 20, dtype=torch.uint8, device=device)
    got = memory_metrics(device)
    # the 256 MiB block is before the reset: the peak is what is held plus the 16 MiB block, not 256 MiB more
    assert held + 16 / 1024 <= got["memory/max_allocated_gb"] < held + 200 / 1024
    assert got["memory/max_reserved_gb"] >= got["memory/max_allocated_gb"]
    del small
