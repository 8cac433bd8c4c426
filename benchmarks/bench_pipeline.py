"""Pipelined vs on-policy GRPO: completion tokens/s of whole ``rlflow fit`` runs, ``data.pipeline.max_staleness`` 1
vs 0.

Runs the same config (the CPU demo by default) with each setting in turn, interleaved (0, 1, 0, 1, ...) so that
load from other processes hits both alike, each as its own ``rlflow fit`` process; ``--partial`` adds
``max_staleness: 1`` with ``data.pipeline.partial_rollouts``. A run's throughput is its completion tokens (from
``metrics.csv``) over the wall time from the start of the first rollout step to the end of the last (model
loading excluded, the generator process's start-up included); "after step 0" leaves the first step out. Prints
each run (with its first step's time, when the generator process was ready and the load average), every reward
curve, the staleness figures, the reward gain (mean of the last 5 steps minus the first 5) per seed with the
mean and spread of the difference to the on-policy run, the ratio of each repeat's runs (back to back, so robust
to the machine's speed drifting between repeats) and on its last line the ratio of the medians (max_staleness 1
over 0) with the load before and after. Runs are deterministic for a seed, so repeats only
re-measure time; ``--seeds`` measures the reward-gain noise.

    python benchmarks/bench_pipeline.py --config configs/demo_cpu.yaml --steps 50 --repeats 2 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[1]


class WallClock(L.Callback):
    """Writes the wall time of the training loop (first rollout step start to last step end) to ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.start = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.start:
            self.start = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps({"seconds": time.perf_counter() - self.start}))


def load() -> str:
    return "load " + " ".join(f"{x:.2f}" for x in os.getloadavg())


SETTINGS = {
    "on-policy (max_staleness 0)": ["--data.pipeline.max_staleness=0"],
    "pipelined (max_staleness 1)": ["--data.pipeline.max_staleness=1"],
    "partial rollouts (max_staleness 1)": ["--data.pipeline.max_staleness=1", "--data.pipeline.partial_rollouts=true"],
}


def run(config: str, setting: list[str], seed: int, steps: int, out: Path, extra: list[str]) -> dict:
    shutil.rmtree(out, ignore_errors=True)  # a run's own metrics.csv, not one left by an earlier invocation
    out.mkdir(parents=True)
    clock = out / "clock.json"
    args = [
        sys.executable,
        "-m",
        "rlflow",
        "fit",
        "--config",
        config,
        f"--trainer.max_steps={steps}",
        f"--seed_everything={seed}",
        f"--data.seed={seed}",
        *setting,
        "--model.export_hf=false",
        "--summary.enabled=false",
        "--trainer.enable_progress_bar=false",
        f"--trainer.logger.init_args.save_dir={out}",
        "--trainer.logger.init_args.name=run",
        f'--trainer.callbacks+={{"class_path": "benchmarks.bench_pipeline.WallClock", '
        f'"init_args": {{"path": "{clock}"}}}}',
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"rlflow fit failed ({' '.join(setting)}):\n{proc.stderr[-3000:]}")
    rows = [r for r in csv.DictReader(open(next(out.glob("run/version_*/metrics.csv")))) if r.get("reward")]
    seconds = json.loads(clock.read_text())["seconds"]
    batch = _completions_per_step(config)
    tokens = sum(float(r["completions/mean_length"]) * batch for r in rows)  # mean length x completions
    rewards = [float(r["reward"]) for r in rows]
    first = float(rows[0]["step_time"])  # the first step (the generator process starts meanwhile, when pipelined)
    first_tokens = float(rows[0]["completions/mean_length"]) * batch
    log = proc.stdout + proc.stderr  # rlflow's messages go to stdout
    ready = re.search(r"generator process \d+ ready ([\d.]+) s after its start", log)
    threads = re.search(r"the trainer uses (\d+) torch threads", log)

    def column(key: str, default: float = 0.0) -> list[float]:
        return [float(r.get(key) or default) for r in rows]

    return {
        "seconds": seconds,
        "tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "steady_tokens_per_s": (tokens - first_tokens) / max(seconds - first, 1e-9),
        "first_step": first,
        "median_step": statistics.median(column("step_time")),
        "generator_ready": float(ready.group(1)) if ready else None,
        "trainer_threads": int(threads.group(1)) if threads else None,
        "rewards": rewards,
        "gain": statistics.fmean(rewards[-5:]) - statistics.fmean(rewards[:5]),
        "gain_se": gain_se(rewards),
        "staleness_max": max(column("sampling/staleness/max")),
        "staleness_mean": statistics.fmean(column("sampling/staleness/mean")),
        "token_staleness_mean": statistics.fmean(column("sampling/staleness/token_mean")),
        "is_ratio_min": min(column("sampling/importance_sampling_ratio/min", 1.0)),
        "is_ratio_max": max(column("sampling/importance_sampling_ratio/max", 1.0)),
        "wait": sum(column("rollout/wait_time")),
    }


def _completions_per_step(config: str) -> int:
    import yaml

    data = yaml.safe_load(open(ROOT / config))["data"]
    return int(data["global_batch_size"]) * int(data["prompt_repeat_k"])


def gain_se(rewards: list[float]) -> float:
    """Standard error of the gain (mean of the last 5 steps minus the first 5) from the step-to-step scatter of the
    rewards inside each window: what one run's gain is known to."""
    return (statistics.variance(rewards[-5:]) / 5 + statistics.variance(rewards[:5]) / 5) ** 0.5


def spread(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"mean {statistics.fmean(values):+.3f}, sd {sd:.3f}, range [{min(values):+.3f}, {max(values):+.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo_cpu.yaml")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting and seed (timing)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="seed_everything and data.seed")
    parser.add_argument(
        "--partial", action="store_true", help="also max_staleness 1 with data.pipeline.partial_rollouts"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench_pipeline"))
    parser.add_argument("extra", nargs="*", help="more rlflow fit arguments, for every setting (after --)")
    args = parser.parse_args()
    names = list(SETTINGS)[: 3 if args.partial else 2]
    before = load()
    print(
        f"{os.cpu_count()} cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, {before}; "
        f"{args.config}, {args.steps} steps, seeds {args.seeds}, {args.repeats} repeat(s)",
        flush=True,
    )
    results: dict[str, dict[int, list[dict]]] = {n: {s: [] for s in args.seeds} for n in names}
    for seed in args.seeds:
        for rep in range(args.repeats):
            for i, name in enumerate(names):
                r = run(args.config, SETTINGS[name], seed, args.steps, args.out / f"seed{seed}_r{rep}_{i}", args.extra)
                results[name][seed].append(r)
                ready = f", generator ready {r['generator_ready']:.1f} s" if r["generator_ready"] is not None else ""
                threads = f", trainer threads cut to {r['trainer_threads']}" if r["trainer_threads"] else ""
                print(
                    f"{name} seed {seed} repeat {rep}: {r['seconds']:.1f} s, {r['tokens']:.0f} completion tokens, "
                    f"{r['tokens_per_s']:.0f} tok/s ({r['steady_tokens_per_s']:.0f} after step 0), first step "
                    f"{r['first_step']:.2f} s{ready}, median step {r['median_step']:.3f} s{threads}, reward gain "
                    f"{r['gain']:+.3f}, staleness mean {r['staleness_mean']:.2f} max {r['staleness_max']:.0f} "
                    f"(per token {r['token_staleness_mean']:.2f}), IS ratio in [{r['is_ratio_min']:.3f}, "
                    f"{r['is_ratio_max']:.3f}], trainer waited {r['wait']:.1f} s, {load()}",
                    flush=True,
                )
    for name in names:
        for seed in args.seeds:
            curve = " ".join(f"{x:.2f}" for x in results[name][seed][0]["rewards"])
            print(f"reward curve, {name}, seed {seed}: {curve}")
    base = names[0]
    for name in names[1:]:
        diffs = [results[name][s][0]["gain"] - results[base][s][0]["gain"] for s in args.seeds]
        ses = [(results[name][s][0]["gain_se"] ** 2 + results[base][s][0]["gain_se"] ** 2) ** 0.5 for s in args.seeds]
        per_seed = ", ".join(
            f"seed {s}: {results[name][s][0]['gain']:+.3f} vs {results[base][s][0]['gain']:+.3f} "
            f"(difference {d:+.3f} +- {se:.3f} standard error)"
            for s, d, se in zip(args.seeds, diffs, ses)
        )
        mean_se = (sum(se**2 for se in ses) ** 0.5) / len(ses)
        print(
            f"reward gain, {name} vs {base}: {per_seed}; difference {spread(diffs)}, standard error of the mean "
            f"difference {mean_se:.3f}; within 0.05 on {sum(abs(d) <= 0.05 for d in diffs)} of {len(diffs)} "
            f"seeds; mean within 0.05: {abs(statistics.fmean(diffs)) <= 0.05}"
        )
    base_gains = [results[base][s][0]["gain"] for s in args.seeds]
    print(f"reward gain, {base} alone across seeds: {spread(base_gains)} (the seed-to-seed noise of the anchor)")

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for s in args.seeds for r in results[name][s])

    for name in names[1:]:
        for key, label in (("steady_tokens_per_s", "after step 0"), ("tokens_per_s", "whole run")):
            print(
                f"{name} / {base} completion tokens/s, {label}: {median(name, key) / median(base, key):.2f}x "
                f"({median(name, key):.0f} vs {median(base, key):.0f})"
            )
        # each repeat's runs ran back to back: robust to the machine's speed drifting between repeats (on a shared
        # host it moves by 10-40% in minutes)
        pairs = [
            a["tokens_per_s"] / b["tokens_per_s"]
            for s in args.seeds
            for a, b in zip(results[name][s], results[base][s])
        ]
        print(
            f"{name} / {base} completion tokens/s, whole run, paired by repeat: median "
            f"{statistics.median(pairs):.2f}x (each: {', '.join(f'{p:.2f}x' for p in pairs)})"
        )
    print(
        f"max_staleness=1 / max_staleness=0 completion tokens/s: "
        f"{median(names[1], 'tokens_per_s') / median(base, 'tokens_per_s'):.2f}x "
        f"({median(names[1], 'tokens_per_s'):.0f} vs {median(base, 'tokens_per_s'):.0f}; {before} before, "
        f"{load()} after)"
    )


if __name__ == "__main__":
    main()
