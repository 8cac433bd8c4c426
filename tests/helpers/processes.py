"""The environment of an ``rlflow`` subprocess a test launches, with a rendezvous port of its own.

Lightning picks a free port for a multi-rank run's rendezvous in the launching process, and rank 0 binds it seconds
later (after its imports). On a busy machine another process's outgoing connection can take that port in between:
ports a program is not told to use come from the kernel's ephemeral range (``ip_local_port_range``). So each launch
gets ``MASTER_PORT`` below that range, from a block of ports of its own per pytest-xdist worker, checked free.
"""

from __future__ import annotations

import itertools
import os
import socket

from tests.helpers.paths import ROOT

#: Ports handed out start here, below Linux's default ephemeral range (32768-60999); each xdist worker has a block.
FIRST_PORT = 20000
PORTS_PER_WORKER = 1000
_next = itertools.count()


def _worker_index() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")  # "gw3"; absent without xdist
    return int(worker[2:]) if worker[2:].isdigit() else 0


def _is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def rendezvous_port() -> int:
    """A free port of this worker's block that no earlier call of this process returned."""
    block = FIRST_PORT + (_worker_index() % 12) * PORTS_PER_WORKER
    for _ in range(PORTS_PER_WORKER):
        port = block + (next(_next) + os.getpid()) % PORTS_PER_WORKER
        if _is_free(port):
            return port
    raise RuntimeError(f"no free port in {block}-{block + PORTS_PER_WORKER - 1}")


#: What a launched process must not inherit: these make Lightning take it for a rank someone else launched.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                  "TORCHELASTIC_RUN_ID")


def rlflow_env(**extra: str) -> dict[str, str]:
    """``os.environ`` for ``python -m rlflow`` in a subprocess: the repository importable (tests' plugins), one torch
    thread a rank, no inherited rank, and a rendezvous address and port of its own; ``extra`` added last."""
    inherited = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
    env = dict(inherited, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(rendezvous_port()))
    env.update(extra)
    return env
