"""Print the reward curve of an rlflow run from its CSV metrics, and the first-5 vs last-5 steps' mean reward (and,
where the run logged it, the gap between the rollout's and the trainer's log-probs of the sampled tokens, and the
peak memory of its largest step).

    python tools/summarize_run.py runs/demo            # the newest version_* under runs/demo
    python tools/summarize_run.py runs/demo/version_3  # one run
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

GAP = "sampling/sampling_logp_difference/"
MEMORY = {"memory/max_rss_gb": "trainer process resident", "memory/max_allocated_gb": "GPU allocated",
          "memory/max_reserved_gb": "GPU reserved"}


def newest_run(path: Path) -> Path:
    if (path / "metrics.csv").exists():
        return path
    versions = sorted(path.glob("version_*"), key=lambda p: int(p.name.split("_")[1]))
    if not versions:
        sys.exit(f"no metrics.csv under {path}")
    return versions[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    args = parser.parse_args()
    run = newest_run(args.run)
    rows = list(csv.DictReader((run / "metrics.csv").open()))
    train = [r for r in rows if r.get("reward")]
    evals = [r for r in rows if r.get("eval/accuracy")]
    print(f"run: {run}")
    tools = bool(train) and bool(train[0].get("tools/call_frequency"))  # a multi-turn run with tools
    header = "step  reward  reward_std  mean_len  clipped  step_time"
    print(header + ("  tool_calls  tool_fail  turns" if tools else ""))
    for r in train:
        extra = (f"  {float(r['tools/call_frequency']):10.3f}  {float(r['tools/failure_frequency']):9.3f}  "
                 f"{float(r['turns/mean']):5.2f}" if tools else "")
        print(f"{int(float(r['step'])):4d}  {float(r['reward']):6.3f}  {float(r['reward_std']):10.3f}  "
              f"{float(r['completions/mean_length']):8.1f}  {float(r['completions/clipped_ratio']):7.2f}  "
              f"{float(r['step_time']):8.2f}s" + extra)
    for r in evals:
        reward = f"reward {float(r['eval/reward']):.3f}, " if r.get("eval/reward") else ""
        print(f"eval at step {int(float(r['step']))}: {reward}accuracy {float(r['eval/accuracy']):.3f}")
    rewards = [float(r["reward"]) for r in train]
    if len(rewards) >= 10:
        first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        total = sum(float(r["step_time"]) for r in train)
        print(f"mean reward: first 5 steps {first:.3f}, last 5 steps {last:.3f}, gain {last - first:+.3f} "
              f"over {len(rewards)} steps in {total:.0f}s of step time")
        if tools:
            calls = [float(r["tools/call_frequency"]) for r in train]
            print(f"tool calls per trajectory: first 5 steps {sum(calls[:5]) / 5:.3f}, last 5 steps "
                  f"{sum(calls[-5:]) / 5:.3f}")
    peaks = {name: max(values) for name in MEMORY if (values := [float(r[name]) for r in train if r.get(name)])}
    if peaks:  # the largest step's figures (rlflow.training.memory_metrics)
        print("peak memory: " + ", ".join(f"{MEMORY[name]} {value:.2f} GiB" for name, value in peaks.items()))
    gap = [(float(r[GAP + "mean"]), float(r[GAP + "max"])) for r in train if r.get(GAP + "mean")]
    if gap:  # logged with model.rollout_correction: the engine's against the trainer's log-probs of sampled tokens
        print(f"rollout/training log-prob gap of the sampled tokens: mean {sum(m for m, _ in gap) / len(gap):.3g}, "
              f"largest {max(x for _, x in gap):.3g} (over {len(gap)} steps)")


if __name__ == "__main__":
    main()
