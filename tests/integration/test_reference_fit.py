"""``model.reference.sync_steps`` through ``rlflow fit``: a fit without a KL term names the fix, a reset zeroes the
next step's KL and the checkpoint holds the moved reference, and checkpoints with and without the reference
continue either way."""

from __future__ import annotations

import pytest
import torch

from rlflow.cli import cli_main
from rlflow.config_error import ConfigError
from tests.helpers.resume_helpers import last_checkpoint, metrics_by_step, run_args


def test_fit_without_a_kl_term_names_the_fix(tiny_model, small_data, tmp_path):
    with pytest.raises(ConfigError, match="set model.loss.init_args.kl_coef > 0 or model.reference.sync_steps=0"):
        cli_main(run_args(tiny_model, small_data, tmp_path, "--model.reference.sync_steps=2", steps=1))


def test_a_reset_zeroes_the_next_steps_kl_and_the_checkpoint_holds_the_moved_reference(
        tiny_model, small_data, tmp_path, one_thread):
    root = tmp_path / "run"
    cli_main(run_args(tiny_model, small_data, root, "--model.loss.kl_coef=0.05", "--model.reference.sync_steps=2",
                      "--model.reference.mixup_alpha=1.0", steps=4))
    kl = {step: row["kl"] for step, row in metrics_by_step(root).items()}
    assert kl[0] == 0.0  # the reference is the starting policy
    assert kl[1] > 0.0 and kl[3] > 0.0  # the policy moved away from it
    assert kl[2] == 0.0  # reset after step 1: step 2's policy is the reference, bit for bit
    state = torch.load(last_checkpoint(root), weights_only=True)["state_dict"]
    ref = {k[len("reference."):]: v for k, v in state.items() if k.startswith("reference.")}
    policy = {k[len("policy."):]: v for k, v in state.items() if k.startswith("policy.")}
    assert ref and ref.keys() == policy.keys()
    assert all(torch.equal(ref[k], policy[k]) for k in ref)  # reset again after the last step (4 % 2 == 0)


def test_checkpoints_with_and_without_the_reference_continue_either_way(tiny_model, small_data, tmp_path, one_thread):
    """Turning syncing on when continuing a run that had it off starts from the loaded reference; turning it off
    again keeps the reference where it was moved to (the checkpoint's), fixed from then on."""
    kl_on = ["--model.loss.kl_coef=0.05"]
    sync = ["--model.reference.sync_steps=1", "--model.reference.mixup_alpha=1.0"]
    root = tmp_path / "chain"
    cli_main(run_args(tiny_model, small_data, root, *kl_on, steps=2))
    cli_main(run_args(tiny_model, small_data, root, *kl_on, *sync, "--ckpt_path=last", steps=4))
    kl = {step: row["kl"] for step, row in metrics_by_step(root).items()}
    assert kl[1] > 0.0 and kl[2] > 0.0  # step 2 still against the starting reference
    assert kl[3] == 0.0  # reset after step 2
    cli_main(run_args(tiny_model, small_data, root, *kl_on, "--ckpt_path=last", steps=6))
    kl = {step: row["kl"] for step, row in metrics_by_step(root).items()}
    assert kl[4] == 0.0  # the checkpoint's reference (reset after step 3), not the starting one
    assert kl[5] > 0.0  # and it stays there while the policy moves
    state = torch.load(last_checkpoint(root), weights_only=True)["state_dict"]
    assert any(k.startswith("reference.") for k in state)  # still checkpointed

