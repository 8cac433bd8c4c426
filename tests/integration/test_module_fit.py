"""``model.policy.gradient_checkpointing`` through ``rlflow fit``: the same steps as without it."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_gradient_checkpointing_trains_the_same_steps(tiny_model, tiny_data, tmp_path):
    """``model.policy.gradient_checkpointing: true`` (every shipped GPU recipe) recomputes activations in the backward
    pass: the same losses and gradient norms as without it, with the layers checkpointed and no KV cache."""
    import csv
    from pathlib import Path

    import torch

    from rlflow.cli import cli_main
    from rlflow.training.packing import is_checkpointing
    from tests.helpers.fit import fit_args

    runs = {}
    for on in (False, True):
        cli = cli_main(
            fit_args(
                tiny_model,
                tiny_data,
                tmp_path / str(on),
                f"--model.policy.gradient_checkpointing={on}",
                "--seed_everything=0",
                steps=2,
            )
        )
        policy = cli.model.policy
        assert is_checkpointing(policy) == on and policy.config.use_cache is not on
        (metrics,) = Path(cli.trainer.log_dir).glob("metrics.csv")
        runs[on] = [(float(r["loss"]), float(r["grad_norm"])) for r in csv.DictReader(metrics.open()) if r.get("loss")]
    assert len(runs[True]) == 2
    assert torch.allclose(torch.tensor(runs[True]), torch.tensor(runs[False]), rtol=1e-5, atol=1e-7), runs
