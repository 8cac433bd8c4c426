"""What running judgers in worker processes (``data.judging.isolation: process``) costs, against a thread.

Measured in one process that has imported what ``rlflow fit`` has when it builds the judgers (the CLI, the
datamodule, the training module; the zygote preloads all of it):

* start-up: the shared zygote (a fresh ``python -c`` that preloads the rlflow modules this process has, then forks
  the first worker), a worker forked from the warm zygote (what replacing a killed worker costs), and for comparison
  a plain spawn per worker (a fresh interpreter importing the judger's module, what ``spawn`` would pay on every
  start and every replacement);
* per call: ``JudgerRunner.judge`` on 64 completions (strings of 100-300 characters, TRL's keywords and a
  ``ground_truth`` column) with a TRL-style reward function, in a worker process and in a thread; the median of
  ``--repeats`` batches after a warm-up, and the difference;
* the demo's judging (``gsm8k``, rlflow's own) stays in a thread: no worker process is made for it.

Usage::

    python benchmarks/bench_isolation.py --repeats 200
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # run as ``python benchmarks/<name>.py``: the repository root, for ``tests.`` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import rlflow.cli  # noqa: E402, F401 - what rlflow fit has imported when the judgers are built
import rlflow.data.datamodule  # noqa: E402, F401
import rlflow.training.module  # noqa: E402, F401
from rlflow import isolation  # noqa: E402
from rlflow.judgers.runner import InWorker, JudgerRunner  # noqa: E402

REWARD = "tests.helpers.reward_helpers:solution_echo"


def batch(n: int, seed: int = 0):
    rng = random.Random(seed)
    texts = ["".join(rng.choice("0123456789 +-=abc\n") for _ in range(rng.randint(100, 300))) for _ in range(n)]
    ids = [[rng.randint(0, 999) for _ in range(len(t) // 4)] for t in texts]
    columns = {"solution": [str(i % 2) for i in range(n)], "ground_truth": [str(i) for i in range(n)]}
    return [f"prompt {i}" for i in range(n)], texts, ids, columns


def seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def startup() -> None:
    from tests.helpers import reward_helpers

    t0 = time.perf_counter()
    payload, _ = isolation.portable(InWorker(reward_helpers.solution_echo))
    pool = isolation.Isolated(payload, "judger 'solution_echo'")
    assert pool.prepare() is None
    print(f"shared zygote spawned + first worker: {time.perf_counter() - t0:.3f} s "
          f"({len(isolation.preloaded())} rlflow modules preloaded)")
    for line in open(f"/proc/{isolation._SHARED.process.pid}/status"):
        if line.startswith("VmRSS"):
            print(f"zygote resident memory: {int(line.split()[1]) / 1024:.0f} MiB")
    replaced = []
    for _ in range(5):
        worker = pool.acquire()
        worker.kill()
        t0 = time.perf_counter()
        assert pool.prepare() is None
        replaced.append(time.perf_counter() - t0)
    print(f"worker forked from the warm zygote (a replacement): median {statistics.median(replaced) * 1e3:.1f} ms")
    pool.close()
    command = f"import {', '.join(isolation.preloaded())}, {REWARD.split(':')[0]}"
    spawned = [seconds(lambda: subprocess.run([sys.executable, "-c", command], check=True), 1) for _ in range(3)]
    print("for comparison, a spawned interpreter importing the judger's module: "
          f"median {statistics.median(spawned):.3f} s per worker")


def per_call(repeats: int) -> None:
    args = batch(64)
    medians = {}
    for mode in ("process", "thread"):
        runner = JudgerRunner({"*": REWARD}, timeout=60, isolation=mode)
        for _ in range(5):  # warm-up: the worker (and the zygote) start
            runner.judge(*args)
        medians[mode] = seconds(lambda: runner.judge(*args), repeats)  # noqa: B023 - used at once
        runner.close()
    for mode, value in medians.items():
        print(f"judge(64 completions), {mode}: median {value * 1e3:.2f} ms")
    print(f"process - thread: {(medians['process'] - medians['thread']) * 1e3:.2f} ms per judged batch")
    demo = JudgerRunner({"openai/gsm8k": "gsm8k"})
    assert demo.pool("gsm8k") is None
    print("demo judging (gsm8k): in a thread, no worker process")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    startup()
    per_call(args.repeats)


if __name__ == "__main__":
    main()
