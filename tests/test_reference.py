"""``model.ref_model_sync_steps``: the KL reference moved toward the policy (rlflow/training/reference.py).

The update is checked against the soft-update formula computed apart in float64; end to end, a reset
(``alpha = 1``) makes the next step's KL exactly 0 and the checkpoint carries the moved reference (exact resume
is ``test_resume_matrix.py``'s ``reference-sync`` case).
"""

from __future__ import annotations

import re

import pytest
import torch
from resume_helpers import last_checkpoint, metrics_by_step, run_args

from rlflow.cli import cli_main
from rlflow.config_error import ConfigError
from rlflow.training.reference import check_same_layout, check_sync, sync_reference


def tiny_pair(tiny_model, seed: int):
    """The tiny model and a copy of it with other random weights."""
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model)
    ref = AutoModelForCausalLM.from_pretrained(tiny_model)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p))
    return policy, ref


@pytest.mark.parametrize("alpha", [0.6, 0.25])
def test_sync_is_the_soft_update_computed_apart(tiny_model, alpha):
    policy, ref = tiny_pair(tiny_model, 1)
    before_ref = {n: p.detach().double().clone() for n, p in ref.named_parameters()}
    before_policy = {n: p.detach().clone() for n, p in policy.named_parameters()}
    sync_reference(ref, policy, alpha)
    for name, r in ref.named_parameters():
        expected = (1.0 - alpha) * before_ref[name] + alpha * before_policy[name].double()
        assert not torch.equal(before_ref[name], expected)  # the update moves every parameter
        torch.testing.assert_close(r.double(), expected, rtol=1e-6, atol=1e-6)
    for name, p in policy.named_parameters():  # the policy is read, never written
        assert torch.equal(p, before_policy[name])


def test_alpha_one_resets_the_reference_to_the_policy_exactly(tiny_model):
    policy, ref = tiny_pair(tiny_model, 2)
    sync_reference(ref, policy, 1.0)
    for (_, r), (_, p) in zip(ref.named_parameters(), policy.named_parameters()):
        assert torch.equal(r, p)


@pytest.mark.parametrize(("args", "message"), [
    ((-1, 0.6, True, False), "ref_model_sync_steps must be an integer >= 0"),
    ((2, 0.0, True, False), "ref_model_mixup_alpha must be in (0, 1]"),
    ((2, 1.5, True, False), "ref_model_mixup_alpha must be in (0, 1]"),
    ((2, 0.6, False, False), "no KL term (model.kl_coef is 0)"),
    ((2, 0.6, True, True), "not supported with model.lora"),
])
def test_settings_that_cannot_act_are_config_errors(args, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_sync(*args)
    check_sync(0, 0.6, False, True)  # off: nothing to check against the loss or LoRA


def test_a_reference_of_another_shape_is_refused(tiny_model, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model)
    config = AutoConfig.from_pretrained(tiny_model)
    config.intermediate_size *= 2
    with pytest.raises(ConfigError, match="different parameters"):
        check_same_layout(policy, AutoModelForCausalLM.from_config(config))


def test_fit_without_a_kl_term_names_the_fix(tiny_model, small_data, tmp_path):
    with pytest.raises(ConfigError, match="set model.kl_coef > 0 or model.ref_model_sync_steps=0"):
        cli_main(run_args(tiny_model, small_data, tmp_path, "--model.ref_model_sync_steps=2", steps=1))


def test_a_reset_zeroes_the_next_steps_kl_and_the_checkpoint_holds_the_moved_reference(
        tiny_model, small_data, tmp_path, one_thread):
    root = tmp_path / "run"
    cli_main(run_args(tiny_model, small_data, root, "--model.kl_coef=0.05", "--model.ref_model_sync_steps=2",
                      "--model.ref_model_mixup_alpha=1.0", steps=4))
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
    kl_on = ["--model.kl_coef=0.05"]
    sync = ["--model.ref_model_sync_steps=1", "--model.ref_model_mixup_alpha=1.0"]
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
