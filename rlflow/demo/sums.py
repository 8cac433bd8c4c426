"""Sums written in GSM8K's RL format, the task of the SmolLM2 CPU recipe (``configs/smollm2_sums_cpu.yaml``).

Each row asks for ``a + b`` (``a`` in 1-30, ``b`` in 1-9) and asks for the answer after ``####``, with a worked
example in the instruction (``for 5 + 7 you would write "#### 12"``). SmolLM2-135M-Instruct adds such numbers
right most of the time but almost never writes GSM8K's ``#### <answer>`` line unprompted: the recipe rewards the
sum (:func:`final_number_reward`, the last number of the completion) and GSM8K's strict answer line (the ``gsm8k``
judger) equally, so GRPO has a signal from the first step and room to learn the format. Copying the example's
``#### 12`` earns nothing unless 12 is the sum.

The held-out rows (``val.jsonl``) are sums never trained on. :func:`write_data` writes both files;
``python -m rlflow.demo.sums --out checkpoints/sums`` is its command line.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path
from typing import Any

INSTRUCTION = 'Write the sum after "####". For example, for 5 + 7 you would write "#### 12".'
NUMBER = re.compile(r"-?\d+")


def problems() -> list[tuple[int, int]]:
    """Every ``(a, b)`` of the task: ``a`` in 1-30, ``b`` in 1-9."""
    return [(a, b) for a in range(1, 31) for b in range(1, 10)]


def row(index: int, split: str, a: int, b: int) -> dict[str, Any]:
    """One row in XTuner's / verl's GSM8K RL layout."""
    question = f"What is {a} + {b}?"
    return {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"ground_truth": str(a + b), "style": "rule"},
        "extra_info": {"index": index, "split": split, "question": question,
                       "answer": f"{a} + {b} = {a + b}\n#### {a + b}"},
    }


def write_data(out_dir: Path, n_val: int = 64, seed: int = 0) -> tuple[Path, Path]:
    """``train.jsonl`` and ``val.jsonl`` (``n_val`` held-out sums) under ``out_dir``; the split is fixed by ``seed``."""
    pairs = problems()
    random.Random(seed).shuffle(pairs)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "train.jsonl", out_dir / "val.jsonl"
    for path, split, chosen in ((paths[0], "train", pairs[n_val:]), (paths[1], "val", pairs[:n_val])):
        with path.open("w", encoding="utf-8") as f:
            for i, (a, b) in enumerate(chosen):
                f.write(json.dumps(row(i, split, a, b)) + "\n")
    return paths


def final_number_reward(completions: list[Any], ground_truth: list[Any], **_: Any) -> list[float]:
    """1.0 where the completion's last number equals ``ground_truth``, else 0.0 (a TRL-style reward function)."""
    rewards = []
    for completion, truth in zip(completions, ground_truth):
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        numbers = NUMBER.findall(text)
        rewards.append(1.0 if numbers and numbers[-1] == str(truth).strip() else 0.0)
    return rewards


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("checkpoints/sums"))
    parser.add_argument("--n-val", type=int, default=64)
    args = parser.parse_args(argv)
    train, val = write_data(args.out, args.n_val)
    print(f"sums: {train} and {val}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
