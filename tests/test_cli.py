"""End to end: ``rlflow fit`` on the tiny model, config handling, and the HF export."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, fit_args
from rlflow.cli import cli_main

pytestmark = pytest.mark.slow


def read_metrics(log_dir):
    with open(log_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def test_fit_three_steps_end_to_end(tiny_model, tiny_data, tmp_path):
    cli = cli_main(fit_args(tiny_model, tiny_data, tmp_path, "--model.kl_coef=0.01", steps=3))
    trainer = cli.trainer
    assert trainer.global_step == 3
    log_dir = __import__("pathlib").Path(trainer.log_dir)
    rows = read_metrics(log_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for name in ("reward", "reward_std", "frac_reward_zero_std", "rewards/gsm8k/mean", "completions/mean_length",
                 "completions/clipped_ratio", "entropy", "kl", "clip_ratio/region_mean", "loss", "grad_norm",
                 "num_tokens", "step_time"):
        assert name in rows[-1], name
    # num_tokens is cumulative: it grows every step
    assert rows[0]["num_tokens"] < rows[1]["num_tokens"] < rows[2]["num_tokens"]
    assert all(0.0 <= r["completions/clipped_ratio"] <= 1.0 for r in rows)
    assert all(r["completions/mean_length"] <= 12 for r in rows)
    # trajectories: 3 steps x 4 prompts x 4 completions, with rewards and advantages
    lines = [json.loads(l) for l in (log_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len(lines) == 3 * 4 * 4
    assert {l["step"] for l in lines} == {0, 1, 2}
    assert all({"prompt", "completion", "reward", "advantage"} <= set(l) for l in lines)
    # a Lightning checkpoint was written
    assert list((log_dir / "checkpoints").glob("*.ckpt"))


def test_hf_export_reloads_with_identical_logits(tiny_model, tiny_data, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cli = cli_main(fit_args(tiny_model, tiny_data, tmp_path, steps=1))
    hf_dir = __import__("pathlib").Path(cli.trainer.log_dir) / "hf"
    reloaded = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    AutoTokenizer.from_pretrained(hf_dir)  # the tokenizer is exported beside it
    policy = cli.model.policy.eval()
    ids = torch.tensor([[5, 9, 17, 23, 42, 11]])
    with torch.no_grad():
        assert torch.equal(policy(ids).logits, reloaded(ids).logits)
    # and the weights actually moved away from the initial model (lr 1e-3, one step)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    with torch.no_grad():
        assert not torch.equal(initial(ids).logits, reloaded(ids).logits) or cli.model.last_metrics["grad_norm"] == 0


def test_print_config_and_console_script(tiny_model, tiny_data, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "rlflow", *fit_args(tiny_model, tiny_data, tmp_path)[:8], "--print_config"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "prompt_repeat_k: 4" in out.stdout
    assert f"tokenizer_path: {tiny_model}" in out.stdout or "model_path" in out.stdout


def test_prompt_repeat_k_of_one_is_refused(tiny_model, tiny_data, tmp_path):
    with pytest.raises(ValueError, match="at least 2"):
        cli_main(fit_args(tiny_model, tiny_data, tmp_path, "--data.prompt_repeat_k=1"))


def test_validate_reports_eval_accuracy(tiny_model, tiny_data, tmp_path):
    args = fit_args(tiny_model, tiny_data, tmp_path, f"--data.eval_data_path={tiny_data / 'val.jsonl'}")
    args[0] = "validate"
    args = [a for a in args if not a.startswith("--trainer.max_steps")]
    cli = cli_main(args)
    metrics = cli.trainer.callback_metrics
    assert "eval/accuracy" in metrics and 0.0 <= float(metrics["eval/accuracy"]) <= 1.0
