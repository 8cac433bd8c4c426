"""``model.reference.sync_steps``: the KL reference moved toward the policy (rlflow/training/reference.py).

The update is checked against the soft-update formula computed apart in float64. End to end (a reset makes the
next step's KL exactly 0, the checkpoint carries the moved reference): ``tests/integration/test_reference_fit.py``;
exact resume is ``test_resume_matrix.py``'s ``reference-sync`` case.
"""


from __future__ import annotations

import re

import pytest
import torch

from rlflow.config_error import ConfigError
from rlflow.training.reference import check_same_layout, sync_reference
from rlflow.training.settings import ReferenceSettings


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


@pytest.mark.parametrize(("settings", "use", "message"), [
    (dict(sync_steps=-1), (True, False), "model.reference.sync_steps must be an integer >= 0"),
    (dict(sync_steps=2, mixup_alpha=0.0), (True, False), "model.reference.mixup_alpha must be in (0.0, 1.0]"),
    (dict(sync_steps=2, mixup_alpha=1.5), (True, False), "model.reference.mixup_alpha must be in (0.0, 1.0]"),
    (dict(sync_steps=2), (False, False), "no KL term (model.loss.init_args.kl_coef is 0)"),
    (dict(sync_steps=2), (True, True), "not supported with model.lora"),
])
def test_settings_that_cannot_act_are_config_errors(settings, use, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        ReferenceSettings(**settings).check_use(*use)
    ReferenceSettings(sync_steps=0).check_use(False, True)  # off: nothing to check against the loss or LoRA


def test_a_reference_of_another_shape_is_refused(tiny_model, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(tiny_model)
    config = AutoConfig.from_pretrained(tiny_model)
    config.intermediate_size *= 2
    with pytest.raises(ConfigError, match="different parameters"):
        check_same_layout(policy, AutoModelForCausalLM.from_config(config))

