"""``GRPOModule``'s configuration: the loss owns its hyper-parameters (``model.loss.init_args``), and a reference
model is loaded iff the loss has a KL term."""


from __future__ import annotations

import pytest

from rlflow.losses.clipped import BNPOLoss, GRPOLoss
from rlflow.training.module import GRPOModule, build_loss


def test_the_loss_is_built_from_a_name_a_mapping_or_an_object():
    assert isinstance(build_loss("bnpo"), BNPOLoss)
    loss = build_loss({"class_path": "bnpo", "init_args": {"kl_coef": 0.01, "epsilon_high": 0.28}})
    assert isinstance(loss, BNPOLoss) and loss.kl_coef == 0.01 and loss.epsilon_high == 0.28
    given = GRPOLoss(kl_coef=0.01, epsilon_high=0.28)
    assert build_loss(given) is given


def test_the_reference_model_follows_the_losss_kl_coef(tiny_model):
    with_kl = GRPOModule(str(tiny_model), loss=GRPOLoss(kl_coef=0.01))
    assert with_kl.uses_reference
    assert not GRPOModule(str(tiny_model), loss="grpo").uses_reference
    assert (
        GRPOModule(str(tiny_model), loss={"class_path": "bnpo", "init_args": {"kl_coef": 0.02}}).loss_fn.kl_coef == 0.02
    )


@pytest.mark.parametrize("units,speedup", [(True, 6.0), (False, 0.1), (True, 0.52)])
def test_bf16_precision_on_a_cpu_without_bf16_hardware_is_named(monkeypatch, units, speedup):
    """No bf16 units: emulated, named; units whose products measure 0.52x float32's (AVX512-BF16 without AMX):
    named with the figure; units at 6x (AMX): nothing to say."""
    import torch

    import rlflow.rollout.hardware as hardware
    from rlflow.training.module import emulated_bf16

    monkeypatch.setattr(hardware, "native_bf16", lambda device: units)
    monkeypatch.setattr(hardware, "cpu_bf16_speedup", lambda: speedup)
    native = speedup >= 1.0  # nothing to warn of
    if units and not native:
        assert "on this CPU: its bf16 matrix products measure 0.52x float32's here" in emulated_bf16("bf16-mixed",
                                                                                                     torch.device("cpu"))
    if not units:
        assert "no AMX or AVX512-BF16" in emulated_bf16("bf16-mixed", torch.device("cpu"))
    cpu = torch.device("cpu")
    for precision in ("bf16-mixed", "bf16-true"):
        message = emulated_bf16(precision, cpu)
        assert (message is None) == native, message
        if message:
            assert f"trainer.precision={precision}" in message and "--trainer.precision 32-true" in message
    assert emulated_bf16("32-true", cpu) is None and emulated_bf16("16-mixed", cpu) is None
    assert emulated_bf16("bf16-mixed", torch.device("meta")) is None  # not a CPU: not this check's business
    policy = emulated_bf16("32-true", cpu, torch.bfloat16)  # bf16 parameters: their products are bf16 too
    assert (policy is None) == native, policy
    if policy:
        assert "model.policy.dtype=bfloat16" in policy and "float32 parameters" in policy
    assert emulated_bf16("32-true", cpu, torch.float32) is None
    fsdp = emulated_bf16("32-true", cpu, torch.float32, torch.bfloat16)  # fsdp2_bf16: FSDP2 computes in bf16
    assert (fsdp is None) == native, fsdp
    if fsdp:
        assert "fsdp2_bf16" in fsdp and "--trainer.strategy fsdp2" in fsdp
    assert emulated_bf16("32-true", cpu, torch.float32, torch.float32) is None
