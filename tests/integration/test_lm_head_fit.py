"""``rlflow fit`` with a bf16 policy and ``model.policy.cast_lm_head_to_fp32``: the head stays float32 through
training."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from rlflow.models.lm_head import FP32Linear
from tests.helpers.fit import fit_args


@pytest.mark.slow
def test_fit_with_a_bf16_policy_and_a_float32_head(tiny_model, tiny_data, tmp_path):
    """``rlflow fit`` with bf16 weights (the demo model has tied embeddings): the policy's head is an FP32Linear
    with float32 weights before and after the steps, it trains, and the loss stays finite."""
    from rlflow.cli import cli_main

    args = fit_args(
        tiny_model,
        tiny_data,
        tmp_path,
        "--model.policy.dtype=bfloat16",
        "--model.optim.optimizer=adamw_kahan",
        "--model.policy.cast_lm_head_to_fp32=true",
        steps=2,
    )
    pytest.importorskip("optimi")
    cli = cli_main(args)
    head = cli.model.policy.get_output_embeddings()
    assert isinstance(head, FP32Linear) and head.weight.dtype == torch.float32
    assert next(cli.model.policy.model.layers.parameters()).dtype == torch.bfloat16
    rows = [r for r in csv.DictReader(open(Path(cli.trainer.log_dir) / "metrics.csv")) if r.get("loss")]
    assert len(rows) == 2 and all(abs(float(r["loss"])) < 1e3 for r in rows)
