"""Losses through ``rlflow fit``: DAPO with two iterations and optimizer steps, VESPO with token MIS and off-policy
masking, and the adaptive entropy coefficient across a resume."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest

from rlflow.config_error import ConfigError
from tests.helpers.fit import fit_args


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_fit_with_dapo_two_iterations_and_two_optimizer_steps(tiny_model, tiny_data, tmp_path, monkeypatch):
    from rlflow.cli import cli_main
    from rlflow.training.module import GRPOModule

    calls = []
    original = GRPOModule.fill_logprobs

    def counting(self, experiences, attr, model):
        calls.append((self.policy_version, attr))
        return original(self, experiences, attr, model)

    monkeypatch.setattr(GRPOModule, "fill_logprobs", counting)
    args = fit_args(
        tiny_model,
        tiny_data,
        tmp_path,
        "--model.loss=dapo",
        "--model.update.num_iterations=2",
        "--model.update.optimizer_steps=2",
        "--model.update.micro_batch_size=3",
        "--model.loss.epsilon_high=0.28",
        steps=1,
    )
    cli = cli_main(args)
    module = cli.model
    # one rollout step (max_steps counts rollout steps) of 2 iterations x 2 mini-batches = 4 optimizer steps, old
    # log-probs computed once before them
    assert cli.trainer.global_step == 1 and module.policy_version == 4
    assert calls == [(0, "old_logprobs")]
    assert [v for v, _ in module.trained_versions] == [0, 1, 2, 3]
    assert {sampled for _, sampled in module.trained_versions} == {0}
    rows = list(csv.DictReader(open(Path(cli.trainer.log_dir) / "metrics.csv")))
    assert rows and all(math.isfinite(float(r["loss"])) for r in rows if r.get("loss"))


@pytest.mark.slow
def test_fit_with_vespo_token_mis_and_off_policy_masking(tiny_model, tiny_data, tmp_path):
    """The new options through ``rlflow fit``: VESPO with a token MIS correction and off-policy sequence masking
    train and log TRL's ``vespo/phi_seq_mean`` and the dropped share; the engine samples in float32 with the
    training weights, so on the first step phi is 1 up to float rounding and nothing is dropped."""
    from rlflow.cli import cli_main

    loss = '--model.loss={"class_path": "vespo", "init_args": {"off_policy_mask_threshold": 0.5}}'
    cli = cli_main(
        fit_args(tiny_model, tiny_data, tmp_path, loss, "--model.rollout_correction.mode=token_mask", steps=2)
    )
    assert type(cli.model.loss_fn).__name__ == "VESPOLoss" and cli.model.correction.mode == "token_mask"
    rows = [r for r in csv.DictReader(open(Path(cli.trainer.log_dir) / "metrics.csv")) if r.get("loss")]
    assert len(rows) == 2
    assert float(rows[0]["vespo/phi_seq_mean"]) == pytest.approx(1.0, abs=1e-3)
    assert float(rows[0]["off_policy_mask/dropped_ratio"]) == 0.0
    assert all(math.isfinite(float(r["loss"])) for r in rows)


def test_vespo_refuses_a_sequence_level_rollout_correction(tiny_model, tiny_data, tmp_path):
    from rlflow.cli import cli_main

    with pytest.raises(ConfigError, match="sequence_mask is sequence-level: use token_truncate or token_mask"):
        cli_main(
            fit_args(
                tiny_model, tiny_data, tmp_path, "--model.loss=vespo", "--model.rollout_correction.mode=sequence_mask"
            )
        )


@pytest.mark.slow
def test_adaptive_entropy_through_fit_and_resume(tiny_model, tiny_data, tmp_path):
    """``rlflow fit`` logs ``entropy_coef`` each step, moving by delta; a run resumed from its step-2 checkpoint
    continues the straight run's coefficient (the controller is in the checkpoint)."""
    from rlflow.cli import cli_main

    loss = (
        '--model.loss={"class_path": "bnpo", "init_args": {"use_adaptive_entropy": true, "entropy_coef": 0.01, '
        '"entropy_target": 100.0, "entropy_coef_delta": 0.01}}'
    )

    def run(root, steps, *extra):
        cli = cli_main(fit_args(tiny_model, tiny_data, root, loss, *extra, steps=steps))
        rows = [r for r in csv.DictReader(open(Path(cli.trainer.log_dir) / "metrics.csv")) if r.get("loss")]
        return [float(r["entropy_coef"]) for r in rows], cli

    straight, _ = run(tmp_path / "a", 3)
    assert straight == pytest.approx([0.02, 0.03, 0.04])  # entropy is always under a target of 100 nats
    _, first = run(tmp_path / "b", 2, "--checkpoint.every_n_train_steps=1")
    ckpt = Path(first.trainer.log_dir) / "checkpoints" / "last.ckpt"
    resumed, _ = run(tmp_path / "b", 3, f"--ckpt_path={ckpt}")
    assert resumed[-1] == pytest.approx(straight[-1])
