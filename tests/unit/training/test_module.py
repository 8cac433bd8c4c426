"""``GRPOModule``'s configuration: the loss owns its hyper-parameters, ``model.*`` are shortcuts into them."""


from __future__ import annotations

import pytest

from rlflow.config_error import ConfigError
from rlflow.losses.clipped import BNPOLoss, GRPOLoss
from rlflow.training.module import GRPOModule, build_loss

UNSET = {"epsilon_low": None, "epsilon_high": None, "kl_coef": None, "kl_type": None}


def test_shortcuts_configure_a_loss_named_by_string():
    loss = build_loss("bnpo", {**UNSET, "kl_coef": 0.01, "epsilon_high": 0.28}, max_tokens=12)
    assert isinstance(loss, BNPOLoss) and loss.kl_coef == 0.01 and loss.epsilon_high == 0.28 and loss.max_tokens == 12


def test_unset_shortcuts_keep_the_losss_own_values():
    loss = build_loss(GRPOLoss(kl_coef=0.01, epsilon_high=0.28), UNSET, max_tokens=12)
    assert loss.kl_coef == 0.01 and loss.epsilon_high == 0.28


def test_a_conflict_names_both_keys():
    with pytest.raises(
        ConfigError,
        match=r"model.loss.init_args.kl_coef=0.0 conflicts with the loss's own kl_coef=0.01 "
        r"\(model.loss.init_args.kl_coef\)",
    ):
        build_loss({"class_path": "grpo", "init_args": {"kl_coef": 0.01}}, {**UNSET, "kl_coef": 0.0}, max_tokens=12)
    with pytest.raises(ConfigError, match="model.loss.init_args.epsilon_low=0.1 conflicts"):
        build_loss(GRPOLoss(epsilon_low=0.3), {**UNSET, "epsilon_low": 0.1}, max_tokens=12)


def test_a_shortcut_the_loss_does_not_have_is_an_error():
    class Plain:
        def __call__(self, *args, **kwargs):
            raise NotImplementedError

    with pytest.raises(
        ConfigError, match="model.loss.init_args.kl_coef=0.1 does not apply: the loss Plain has no kl_coef"
    ):
        build_loss(Plain(), {**UNSET, "kl_coef": 0.1}, max_tokens=12)


def test_the_reference_model_follows_the_losss_kl_coef(tiny_model):
    with_kl = GRPOModule(str(tiny_model), loss=GRPOLoss(kl_coef=0.01))
    assert with_kl.uses_reference and with_kl.hparams.kl_coef is None
    assert not GRPOModule(str(tiny_model), loss="grpo").uses_reference
    assert (
        GRPOModule(str(tiny_model), loss={"class_path": "bnpo", "init_args": {"kl_coef": 0.02}}).loss_fn.kl_coef == 0.02
    )


@pytest.mark.parametrize("native", [True, False])
def test_bf16_precision_on_a_cpu_without_bf16_hardware_is_named(monkeypatch, native):
    import torch

    import rlflow.rollout.hardware as hardware
    from rlflow.training.module import emulated_bf16

    monkeypatch.setattr(hardware, "native_bf16", lambda device: native)
    cpu = torch.device("cpu")
    for precision in ("bf16-mixed", "bf16-true"):
        message = emulated_bf16(precision, cpu)
        assert (message is None) == native, message
        if message:
            assert f"trainer.precision={precision}" in message and "--trainer.precision 32-true" in message
    assert emulated_bf16("32-true", cpu) is None and emulated_bf16("16-mixed", cpu) is None
    assert emulated_bf16("bf16-mixed", torch.device("meta")) is None  # not a CPU: not this check's business
