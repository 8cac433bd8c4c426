"""tools/summarize_run.py: the curve and the evaluations of a run's metrics.csv, each evaluation with its reward."""

from __future__ import annotations

import csv
import subprocess
import sys

from tests.helpers.paths import ROOT

COLUMNS = ["step", "reward", "reward_std", "completions/mean_length", "completions/clipped_ratio", "step_time",
           "eval/reward", "eval/accuracy"]


def test_each_evaluation_is_printed_with_its_reward_and_accuracy(tmp_path):
    run = tmp_path / "version_0"
    run.mkdir()
    rows = [{"step": s, "reward": 0.1 * s, "reward_std": 0.1, "completions/mean_length": 20,
             "completions/clipped_ratio": 0.0, "step_time": 2.0} for s in range(10)]
    rows.append({"step": 9, "eval/reward": 0.4375, "eval/accuracy": 0.0})
    with open(run / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "summarize_run.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "eval at step 9: reward 0.438, accuracy 0.000" in out
    assert "first 5 steps 0.200, last 5 steps 0.700, gain +0.500" in out


def test_the_rollout_training_log_prob_gap_is_summarised_where_it_was_logged(tmp_path):
    gap = "sampling/sampling_logp_difference/"
    rows = [{"step": s, "reward": 0.5, "reward_std": 0.1, "completions/mean_length": 20,
             "completions/clipped_ratio": 0.0, "step_time": 2.0, gap + "mean": m, gap + "max": x}
            for s, (m, x) in enumerate([(0.01, 0.5), (0.03, 0.25)])]
    with open(tmp_path / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, [*COLUMNS, gap + "mean", gap + "max"])
        writer.writeheader()
        writer.writerows(rows)
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "summarize_run.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert "log-prob gap of the sampled tokens: mean 0.02, largest 0.5 (over 2 steps)" in out


def test_peak_memory_is_the_largest_steps_and_absent_where_not_logged(tmp_path):
    mem = ["memory/max_rss_gb", "memory/max_allocated_gb", "memory/max_reserved_gb"]
    rows = [{"step": s, "reward": 0.5, "reward_std": 0.1, "completions/mean_length": 20,
             "completions/clipped_ratio": 0.0, "step_time": 2.0, **dict(zip(mem, v))}
            for s, v in enumerate([(1.5, 10.25, 12.0), (1.75, 9.0, 12.5)])]
    with open(tmp_path / "metrics.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, [*COLUMNS, *mem])
        writer.writeheader()
        writer.writerows(rows)
    run = [sys.executable, str(ROOT / "tools" / "summarize_run.py"), str(tmp_path)]
    out = subprocess.run(run, capture_output=True, text=True, timeout=60, check=True).stdout
    assert "peak memory: trainer process resident 1.75 GiB, GPU allocated 10.25 GiB, GPU reserved 12.50 GiB" in out
    with open(tmp_path / "metrics.csv", "w", newline="") as f:  # a CPU run: the resident figure alone
        writer = csv.DictWriter(f, [*COLUMNS, mem[0]])
        writer.writeheader()
        writer.writerows([{k: v for k, v in r.items() if k in (*COLUMNS, mem[0])} for r in rows])
    out = subprocess.run(run, capture_output=True, text=True, timeout=60, check=True).stdout
    assert "peak memory: trainer process resident 1.75 GiB\n" in out
