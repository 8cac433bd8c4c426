"""bf16 weights through ``rlflow fit``: float32 master weights with bf16-mixed train end to end; bf16 weights with
AdamW barely train, and the run warns."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import pytest
import torch

from rlflow.training.optim import LostUpdatesWarning, UpdateFraction
from tests.helpers.fit import fit_args


def digit_reward(completions, **kwargs):
    """A dense reward (share of digits), so the tiny random model's groups differ and gradients are not zero."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


# ---------------------------------------------------------------------- (d) float32 + bf16-mixed, end to end
def read_metrics(log_dir: Path) -> list[dict[str, float]]:
    with open(log_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def fit_and_compare(tiny_model, tiny_data, tmp_path, monkeypatch, dtype: str, *extra):
    """One rollout step of two optimizer steps at lr 1e-6; the share of weights changed, the logged metrics and
    the fractions ``UpdateFraction.after_step`` returned."""
    from transformers import AutoModelForCausalLM

    from rlflow.cli import cli_main

    returned = []
    original = UpdateFraction.after_step
    monkeypatch.setattr(
        UpdateFraction, "after_step", lambda self, step=None: returned.append(original(self, step)) or returned[-1]
    )
    loaded = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=getattr(torch, dtype))
    before = {k: v.float() for k, v in loaded.state_dict().items()}
    cli = cli_main(fit_args(tiny_model, tiny_data, tmp_path, f"--model.policy.dtype={dtype}", "--model.optim.lr=1e-6",
                            "--model.update.optimizer_steps=2",
                            '--data.judging.judgers={"*": "tests.integration.test_optim_fit:digit_reward"}',
                            "--model.export_hf=false", *extra, steps=1))
    after = {k: v.float() for k, v in cli.model.policy.state_dict().items()}
    changed = sum((after[k] != before[k]).sum().item() for k in before) / sum(v.numel() for v in before.values())
    return changed, read_metrics(Path(cli.trainer.log_dir))[-1], returned, cli


@pytest.mark.slow
def test_float32_master_weights_with_bf16_mixed_train_end_to_end(tiny_model, tiny_data, tmp_path, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error", LostUpdatesWarning)
        changed, row, returned, cli = fit_and_compare(tiny_model, tiny_data, tmp_path, monkeypatch, "float32",
                                                      "--trainer.precision=bf16-mixed")
    assert type(cli.trainer.precision_plugin).__name__ == "MixedPrecision"
    assert all(p.dtype == torch.float32 for p in cli.model.policy.parameters())
    assert changed > 0.9, changed  # all but the embedding rows of characters never seen
    assert len(returned) == 2 and min(returned) > 0.99
    assert row["optim/update_fraction"] == pytest.approx(sum(returned) / 2, rel=1e-6)  # the rollout step's mean


@pytest.mark.slow
def test_bf16_weights_with_adamw_barely_train_end_to_end_and_warn(tiny_model, tiny_data, tmp_path, monkeypatch):
    with pytest.warns(LostUpdatesWarning, match="model.policy.dtype: float32 with trainer.precision: bf16-mixed"):
        changed, row, returned, _ = fit_and_compare(tiny_model, tiny_data, tmp_path, monkeypatch, "bfloat16",
                                                    "--trainer.precision=bf16-true")
    assert changed < 0.1, changed
    assert row["optim/update_fraction"] < 0.1
    assert row["optim/update_fraction"] == pytest.approx(sum(returned) / 2, rel=1e-6)

