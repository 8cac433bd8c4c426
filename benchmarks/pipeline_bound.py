r"""Predict, from on-policy phase timings, how much faster ``data.pipeline.max_staleness: 1`` can make a step on this
CPU.

On a CPU the one-step pipeline (docs/pipelining.md) runs the trainer on one thread and the generator process on
``data.pipeline.generator_threads`` (1), and with ``data.pipeline.lend_cores`` holds the generator while the backward
pass runs on
all the trainer's threads. Whether that beats the on-policy loop depends on how each phase scales with threads,
which this tool measures with ``benchmarks/profile_step.py`` (each profile a process of its own)::

    python benchmarks/pipeline_bound.py --config configs/demo_cpu.yaml --steps 24 [--measure]

1. on one thread, on-policy, without ``data.pipeline.split_rollout``: ``G`` = a rollout's generation and judging on one
   thread (what the generator process does), ``F1``/``B1`` = the training forward/backward on one thread, ``R`` =
   the rest of the trainer's step on one thread (the forward included: whole step - G - B1);
2. on the config's threads, on-policy, as shipped: ``F2``/``B2``, and the on-policy step it is compared with;
3. ``--measure``: the pipelined run itself (``--data.pipeline.max_staleness=1``), to set the prediction against.

A pipelined step is bounded below by the busier of its two processes. The three figures printed:

* ``lend_cores: false``: ``max(R + B1, G)``;
* ``lend_cores: true`` (the default): ``max(R + B2, G + B2)``: the generator is held through the backward;
* the ideal: any share ``f`` of the forward and ``b`` of the backward lent, the generator held meanwhile:
  ``min over f, b in [0, 1] of max(R + B1 - f (F1 - F2) - b (B1 - B2), G + f F2 + b B2)`` (``lent_step``).

Simplifications: the pipelined trainer's own extra work (collecting a job, pushing the weights, the staleness and
importance-ratio metrics) is left out, as is judging's move from G to the trainer, so these are lower bounds on
the pipelined step and upper bounds on its gain; a whole run adds start-up, evaluations and checkpoints to both.
``G`` is measured on one thread: the bound is for ``data.pipeline.generator_threads: 1``, the CPU default.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROLLOUT = "rollout: generate + judge (make_experience)"
FORWARD = "training forward (logprobs_of)"
BACKWARD = "backward (manual_backward)"


def lent_step(gen: float, serial: float, lendable: list[tuple[float, float]]) -> float:
    """The shortest step of two processes sharing the cores. The trainer does ``serial`` work on one thread, and
    each lendable phase ``(one, all)`` takes ``one`` ms on one thread or ``all`` ms on every thread while the
    generator is held, in any proportion; the generator needs ``gen`` on its own thread.

    Lending a share of a phase shortens the trainer by ``share * (one - all)`` and lengthens the generator by
    ``share * all``; at the best shares the two are equal (or nothing is worth lending), and closing the gap at
    the least generator time is a fractional knapsack: lend the phases that gain most per held ms first."""
    trainer, generator = serial + sum(one for one, _ in lendable), gen
    for one, every in sorted(lendable, key=lambda phase: phase[0] / phase[1], reverse=True):
        if trainer <= generator or one <= every:
            break
        share = min(1.0, (trainer - generator) / one)  # the gap closes by `one` per whole phase lent
        trainer, generator = trainer - share * (one - every), generator + share * every
    return max(trainer, generator)


def bounds(one: dict[str, float], many: dict[str, float]) -> dict[str, float]:
    """The three pipelined-step bounds (ms) from a one-thread profile and one at the config's threads."""
    gen, f1, b1, f2, b2 = one[ROLLOUT], one[FORWARD], one[BACKWARD], many[FORWARD], many[BACKWARD]
    rest = one["whole step"] - gen - b1  # the trainer's one-thread work but the backward (forward included)
    return {
        "lend_cores: false": max(rest + b1, gen),
        "lend_cores: true": max(rest + b2, gen + b2),
        "ideal (any share of the forward and backward lent)": lent_step(gen, rest - f1, [(f1, f2), (b1, b2)]),
    }


def profile(config: str, steps: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.json"
        cmd = [
            sys.executable,
            str(ROOT / "benchmarks" / "profile_step.py"),
            "--config",
            config,
            "--steps",
            str(steps),
            "--json",
            str(out),
            *extra,
        ]
        print("$", " ".join(cmd[1:]), flush=True)
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode:
            sys.exit(f"profile_step.py failed (exit {run.returncode}):\n{run.stderr[-4000:]}")
        return json.loads(out.read_text())


def main(argv=None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/demo_cpu.yaml")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--measure", action="store_true", help="also profile the pipelined run (max_staleness 1)")
    args, extra = ap.parse_known_args(argv)
    one = profile(args.config, args.steps, ["--threads", "1", "--data.pipeline.split_rollout=false", *extra])
    many = profile(args.config, args.steps, extra)
    on_policy = many["ms"]["whole step"]
    print(
        f"on one thread: generation + judging {one['ms'][ROLLOUT]:.1f} ms, forward {one['ms'][FORWARD]:.1f}, "
        f"backward {one['ms'][BACKWARD]:.1f}, whole step {one['ms']['whole step']:.1f}"
    )
    print(
        f"on {many['threads']} threads (as configured): forward {many['ms'][FORWARD]:.1f} ms, backward "
        f"{many['ms'][BACKWARD]:.1f}, on-policy step {on_policy:.1f}"
    )
    found = bounds(one["ms"], many["ms"])
    for label, ms in found.items():
        print(f"pipelined step >= {ms:6.1f} ms  ({label}): at most {on_policy / ms:.2f}x the on-policy step")
    if args.measure:
        piped = profile(args.config, args.steps, ["--data.pipeline.max_staleness=1", *extra])["ms"]["whole step"]
        print(f"measured pipelined step {piped:.1f} ms: {on_policy / piped:.2f}x the on-policy step")
        found["measured"] = piped
    found["on-policy"] = on_policy
    return found


if __name__ == "__main__":
    main()
