"""rlflow/training/host_memory.py: large freed blocks stay in the heap and are reused without page faults."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch

from rlflow.training.host_memory import wanted
from tests.helpers.paths import ROOT

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

#: page faults of each of 6 rounds in which a 64 MiB float32 tensor is allocated, filled and freed, after 10 such
#: rounds
FAULTS = """
import resource, sys, torch
from rlflow.training.host_memory import reuse_freed_memory
print(reuse_freed_memory({choice}, torch.device("cpu")))
for _ in range(10):
    torch.ones(16 * 2**20).sum()
for _ in range(6):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(16 * 2**20).sum()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(choice: bool) -> tuple[bool, int]:
    """Whether the allocator was set, and the fewest page faults of a round. The fewest, because the kernel may
    unmap resident pages for its own reasons now and then (automatic NUMA balancing's sampling, swap under memory
    pressure) and every page touched after that faults once more; a fresh mapping faults in every round."""
    out = subprocess.run([sys.executable, "-c", FAULTS.format(choice=choice)], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, check=True).stdout.split()
    return out[0] == "True", min(int(n) for n in out[1:])


def test_it_is_on_by_default_where_the_policy_trains_on_a_cpu_only():
    assert wanted(None, torch.device("cpu")) and not wanted(None, torch.device("cuda"))
    assert wanted(True, torch.device("cuda")) and not wanted(False, torch.device("cpu"))


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt is what it sets; this system's C library is not glibc")
def test_freed_large_blocks_are_reused_without_faulting_their_pages_in_again():
    pages = 16 * 2**20 * 4 // 4096  # the tensor's pages
    on, reused = faults(True)
    off, fresh = faults(False)
    assert on and not off
    assert fresh > pages // 2, fresh  # glibc's default: a fresh mapping each time, faulted in page by page
    assert reused < pages // 20, reused  # the freed block, its pages in place


#: resident MiB after 375 of 400 MiB of small heap blocks were freed, then after ``release_free_memory``; every
#: 16th block stays, so the heap cannot shrink from its top by itself (as a process's heap after a run: holes)
RELEASE = """
from rlflow.training.host_memory import release_free_memory

def resident():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) // 1024

blocks = [bytearray(4096) for _ in range(100_000)]  # under glibc's mmap threshold: in the heap, not mapped apart
kept = blocks[::16]
del blocks
freed = resident()
released = release_free_memory()
print(released, freed, resident())
"""


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_release_gives_the_freed_heap_back_to_the_system():
    out = subprocess.run([sys.executable, "-c", RELEASE], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=True).stdout.split()
    released, freed, after = out[0] == "True", int(out[1]), int(out[2])
    assert released
    assert freed - after > 300  # of the 400 MiB freed, most leave the process
