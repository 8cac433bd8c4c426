"""Pipelined vs on-policy GRPO: completion tokens/s of whole ``rlflow fit`` runs, ``data.max_staleness`` 1 vs 0.

Runs the same config (the CPU demo by default) with each setting in turn, interleaved (0, 1, 0, 1, ...) so that
load from other processes hits both alike, each as its own ``rlflow fit`` process. A run's throughput is its
completion tokens (from ``metrics.csv``) over the wall time from the start of the first rollout step to the end
of the last (model loading excluded, the generator process's start-up included). Prints each run, both reward
curves, the staleness figures, and on its last line the ratio of the medians (max_staleness 1 over 0) with
``uptime``'s load average before and after.

    python tools/bench_pipeline.py --config configs/demo_cpu.yaml --steps 50 --repeats 2
"""

from __future__ import annotations

import argparse
import csv
import json
import os
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
    return os.getloadavg().__repr__()


def run(config: str, staleness: int, steps: int, out: Path, extra: list[str]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    clock = out / "clock.json"
    args = [sys.executable, "-m", "rlflow", "fit", "--config", config, f"--trainer.max_steps={steps}",
            f"--data.max_staleness={staleness}", "--model.export_hf=false", "--summary.enabled=false",
            "--trainer.enable_progress_bar=false", f"--trainer.logger.init_args.save_dir={out}",
            "--trainer.logger.init_args.name=run",
            f'--trainer.callbacks+={{"class_path": "bench_pipeline.WallClock", "init_args": {{"path": "{clock}"}}}}',
            *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tools"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"rlflow fit failed (max_staleness={staleness}):\n{proc.stderr[-3000:]}")
    rows = [r for r in csv.DictReader(open(next(out.glob("run/version_*/metrics.csv")))) if r.get("reward")]
    seconds = json.loads(clock.read_text())["seconds"]
    batch = None
    tokens = 0.0
    for r in rows:  # completion tokens of the step: mean length x completions (the demo's batch x k)
        batch = batch or _completions_per_step(config)
        tokens += float(r["completions/mean_length"]) * batch
    rewards = [float(r["reward"]) for r in rows]
    first = float(rows[0]["step_time"])  # the first step (the generator process's start-up, when pipelined)
    first_tokens = float(rows[0]["completions/mean_length"]) * batch
    return {
        "max_staleness": staleness, "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
        "steady_tokens_per_s": (tokens - first_tokens) / max(seconds - first, 1e-9),
        "rewards": rewards, "gain": statistics.fmean(rewards[-5:]) - statistics.fmean(rewards[:5]),
        "staleness_max": max(float(r.get("sampling/staleness/max") or 0.0) for r in rows),
        "staleness_mean": statistics.fmean(float(r.get("sampling/staleness/mean") or 0.0) for r in rows),
        "is_ratio_min": min(float(r.get("sampling/importance_sampling_ratio/min") or 1.0) for r in rows),
        "is_ratio_max": max(float(r.get("sampling/importance_sampling_ratio/max") or 1.0) for r in rows),
        "wait": sum(float(r.get("rollout/wait_time") or 0.0) for r in rows),
    }


def _completions_per_step(config: str) -> int:
    import yaml

    data = yaml.safe_load(open(ROOT / config))["data"]
    return int(data["global_batch_size"]) * int(data["prompt_repeat_k"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/demo_cpu.yaml")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("runs/bench_pipeline"))
    parser.add_argument("extra", nargs="*", help="more rlflow fit arguments, for both settings (after --)")
    args = parser.parse_args()
    before = load()
    results = {0: [], 1: []}
    for rep in range(args.repeats):
        for staleness in (0, 1):
            r = run(args.config, staleness, args.steps, args.out / f"s{staleness}_r{rep}", args.extra)
            results[staleness].append(r)
            print(f"max_staleness={staleness} repeat {rep}: {r['seconds']:.1f} s, {r['tokens']:.0f} completion tokens, "
                  f"{r['tokens_per_s']:.0f} tok/s ({r['steady_tokens_per_s']:.0f} after step 0), "
                  f"reward gain (last 5 - first 5) {r['gain']:+.3f}, staleness "
                  f"mean {r['staleness_mean']:.2f} max {r['staleness_max']:.0f}, IS ratio in "
                  f"[{r['is_ratio_min']:.3f}, {r['is_ratio_max']:.3f}], trainer waited {r['wait']:.1f} s, "
                  f"load {load()}", flush=True)
    for staleness in (0, 1):
        curve = " ".join(f"{x:.2f}" for x in results[staleness][0]["rewards"])
        print(f"reward curve max_staleness={staleness} (repeat 0): {curve}")
    tps = {s: statistics.median(r["tokens_per_s"] for r in results[s]) for s in (0, 1)}
    steady = {s: statistics.median(r["steady_tokens_per_s"] for r in results[s]) for s in (0, 1)}
    print(f"after step 0 (no start-up): max_staleness=1 / 0 completion tokens/s: {steady[1] / steady[0]:.2f}x")
    gains = {s: statistics.fmean(r["gain"] for r in results[s]) for s in (0, 1)}
    print(f"reward gain: max_staleness=1 {gains[1]:+.3f} vs 0 {gains[0]:+.3f} (difference {gains[1] - gains[0]:+.3f})")
    print(f"max_staleness=1 / max_staleness=0 completion tokens/s: {tps[1] / tps[0]:.2f}x "
          f"({tps[1]:.0f} vs {tps[0]:.0f}; load before {before}, after {load()})")


if __name__ == "__main__":
    main()
