"""What the resume tests share: a small graded run of the tiny model, its logs read back, and the exactness check.

"Exact" means every logged metric of every rollout step (timings aside), every eval metric and every
trajectory row of the interrupted-and-continued run equal those of the uninterrupted run, bit for bit.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import torch

from rlflow.judgers.base import Judger
from tests.helpers.fit import fit_args

#: what a run measures of its machine (wall-clock times, peak memory): never equal between runs
MEASURED = {"step_time", "rollout/time", "rollout/tokens_per_s", "rollout/wait_time", "memory/max_rss_gb",
            "memory/max_allocated_gb", "memory/max_reserved_gb"}


class AdditionSolvedJudger(Judger):
    """Reward 1.0 for every completion of an addition prompt (so its group is solved,
    ``data.filtering.skip_solved``), else the
    share of digits in the completion over 100 (below 1: never solved, and groups differ)."""

    name = "addition_solved"

    def score(self, completion: str, extra_info=None, **sample) -> float:
        if "+" in extra_info["question"]:
            return 1.0
        return sum(ch.isdigit() for ch in completion) / 100


class DigitJudger(Judger):
    """A graded reward: the share of digits in the completion (so groups have different rewards).

    ``binary``: 1.0 for a completion with any digit, else 0.0, so that some groups have equal rewards (dynamic
    sampling drops those and draws more prompts).
    """

    name = "digits"

    def __init__(self, scale: float = 12.0, binary: bool = False) -> None:
        self.scale = scale
        self.binary = binary

    def score(self, completion: str, **sample) -> float:
        digits = sum(ch.isdigit() for ch in completion)
        return float(digits > 0) if self.binary else digits / self.scale


def run_args(tiny_model: Path, data_dir: Path, root: Path, *extra: str, steps: int = 6) -> list[str]:
    """``fit_args`` on ``data_dir/train.jsonl`` with the digit judger, CSV logs flushed every step, no export."""
    args = fit_args(tiny_model, data_dir, root, steps=steps)
    args = [a for a in args if not a.startswith("--trainer.logger.save_dir")]
    return [
        *args,
        f"--trainer.logger.save_dir={root}",
        "--trainer.logger.flush_logs_every_n_steps=1",
        '--data.judging.judgers={"openai/gsm8k": {"class_path": "tests.helpers.resume_helpers.DigitJudger"}}',
        "--model.export_hf=false",
        "--summary.enabled=false",
        *extra,
    ]


def metrics_by_step(root: Path, key: str = "loss") -> dict[int, dict[str, float]]:
    """The logged rows that have ``key`` (``loss``: training steps; ``eval/accuracy``: evaluations), by step, over
    every log version under ``root`` (a resumed run logs to a new version)."""
    rows = {}
    for path in sorted(root.glob("lightning_logs/version_*/metrics.csv")):
        with open(path) as f:
            for row in csv.DictReader(f):
                values = {k: float(v) for k, v in row.items() if v != ""}
                if key in values:
                    assert int(values["step"]) not in rows, f"step {values['step']} logged twice"
                    rows[int(values["step"])] = values
    return rows


def trajectories(root: Path) -> list[dict]:
    lines = []
    for path in sorted(root.glob("lightning_logs/version_*/trajectories.jsonl")):
        lines += [json.loads(line) for line in path.read_text().splitlines()]
    return lines


def assert_same_run(straight: Path, resumed: Path, steps: int) -> None:
    """``resumed`` (all its log versions together) logged exactly what ``straight`` logged, step for step."""
    a, b = metrics_by_step(straight), metrics_by_step(resumed)
    assert sorted(a) == sorted(b) == list(range(steps))
    for step in a:
        assert a[step].keys() == b[step].keys(), step
        for key in a[step].keys() - MEASURED:
            assert a[step][key] == b[step][key], (step, key, a[step][key], b[step][key])
    assert any(a[s]["loss"] != 0.0 for s in a)  # the comparison is not between zeros
    assert metrics_by_step(straight, "eval/accuracy") == metrics_by_step(resumed, "eval/accuracy")
    ta, tb = trajectories(straight), trajectories(resumed)
    assert [t["step"] for t in ta] == sorted(t["step"] for t in ta) and {t["step"] for t in ta} == set(range(steps))
    assert ta == tb


def last_checkpoint(root: Path) -> Path:
    """The ``last.ckpt`` of the newest log version under ``root``."""
    return max(
        root.glob("lightning_logs/version_*/checkpoints/last.ckpt"), key=lambda p: int(p.parts[-3].split("_")[1])
    )


def assert_same_final_state(straight: Path, resumed: Path, steps: int) -> None:
    """The two runs' final ``last.ckpt`` files hold the same step, weights and AdamW moments."""
    final_a = torch.load(last_checkpoint(straight), weights_only=True)
    final_b = torch.load(last_checkpoint(resumed), weights_only=True)
    assert final_a["global_step"] == final_b["global_step"] == steps
    for key, value in final_a["state_dict"].items():
        assert torch.equal(value, final_b["state_dict"][key]), key
    states_a, states_b = final_a["optimizer_states"][0]["state"], final_b["optimizer_states"][0]["state"]
    for sa, sb in zip(states_a.values(), states_b.values()):
        assert torch.equal(sa["exp_avg"], sb["exp_avg"])
