"""``trainer.precision: auto`` (rlflow.training.trainer): bf16-mixed only where the device multiplies bf16 in
hardware, 32-true elsewhere, the choice logged; every other value is Lightning's."""

from __future__ import annotations

import logging

import pytest
import torch

import rlflow.rollout.hardware as hardware
from rlflow.training import trainer as rlflow_trainer
from rlflow.training.trainer import RLFlowTrainer, auto_precision, compute_device


def test_the_accelerator_names_the_device_checked(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert compute_device("auto") is None  # Lightning's auto takes Apple's GPU there: not checked
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert compute_device("auto") == torch.device("cpu") and compute_device("cpu") == torch.device("cpu")
    assert compute_device("gpu") == torch.device("cuda") and compute_device("CUDA") == torch.device("cuda")
    assert compute_device("mps") is None and compute_device(object()) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert compute_device("auto") == torch.device("cuda")  # Lightning's auto takes the GPU where there is one


@pytest.mark.parametrize("units,speedup", [(True, 6.0), (True, 0.52), (False, 0.1)])
@pytest.mark.parametrize("accelerator", ["cpu", "gpu"])
def test_auto_is_bf16_mixed_exactly_where_bf16_is_faster(monkeypatch, units, speedup, accelerator):
    """A CPU with bf16 units (AMX or AVX512-BF16) whose bf16 products measure 6x float32's trains in bf16-mixed; one
    whose measure 0.52x (an AVX512-BF16 Xeon without AMX) and one without bf16 units in float32, each saying why;
    a GPU by its bf16 support."""
    asked = []
    monkeypatch.setattr(hardware, "native_bf16", lambda device: asked.append(device.type) or units)
    monkeypatch.setattr(hardware, "cpu_bf16_speedup", lambda: speedup)
    monkeypatch.setattr(rlflow_trainer, "cpu_bf16_speedup", lambda: speedup)
    monkeypatch.setattr(rlflow_trainer, "native_bf16", hardware.native_bf16)
    precision, reason = auto_precision(accelerator)
    assert asked and set(asked) == {"cpu" if accelerator == "cpu" else "cuda"}
    faster = units and (accelerator == "gpu" or speedup >= hardware.BF16_MARGIN)
    assert precision == ("bf16-mixed" if faster else "32-true")
    if accelerator == "cpu":
        if faster:
            assert "bf16 units, its bf16 products 6.0x as fast as float32's" in reason, reason
        elif units:
            assert "bf16 products run 0.52x as fast as float32's (less than 1.5x)" in reason, reason
        else:
            assert "no AMX or AVX512-BF16" in reason and "emulated" in reason, reason
    else:
        assert ("GPU" in reason) != units and ("CUDA" in reason) == units, reason


def test_the_cpu_speedup_is_measured_once_and_is_a_ratio_of_throughputs():
    hardware.cpu_bf16_speedup.cache_clear()
    state = torch.get_rng_state()
    first = hardware.cpu_bf16_speedup()
    assert torch.equal(torch.get_rng_state(), state)  # a run's seeded draws are not moved by the measurement
    assert first > 0 and hardware.cpu_bf16_speedup() is first  # cached: one measurement per process
    assert hardware.bf16_faster(torch.device("cpu")) == (
        hardware.native_bf16(torch.device("cpu")) and first >= hardware.BF16_MARGIN)


def test_an_accelerator_it_does_not_check_gets_float32(monkeypatch):
    monkeypatch.setattr(rlflow_trainer, "bf16_faster", lambda device: pytest.fail("no device to check"))
    precision, reason = auto_precision("mps")
    assert precision == "32-true" and "'mps'" in reason


@pytest.mark.parametrize("native", [True, False])
def test_the_trainer_resolves_auto_and_logs_why(monkeypatch, caplog, native):
    monkeypatch.setattr(rlflow_trainer, "bf16_faster", lambda device: native)
    monkeypatch.setattr(rlflow_trainer, "cpu_bf16_speedup", lambda: 6.0)
    with caplog.at_level(logging.INFO, logger="rlflow"):
        trainer = RLFlowTrainer(accelerator="cpu", devices=1, precision="auto", logger=False,
                                enable_checkpointing=False, enable_progress_bar=False)
    expected = "bf16-mixed" if native else "32-true"
    assert trainer.precision == expected
    lines = [r.message for r in caplog.records if r.message.startswith("trainer.precision=auto")]
    assert lines == [f"trainer.precision=auto: {expected} ({auto_precision('cpu')[1]})"]


def test_other_values_are_lightnings_unchanged(monkeypatch, caplog):
    monkeypatch.setattr(rlflow_trainer, "bf16_faster", lambda device: pytest.fail("not asked for an explicit value"))
    for precision, expected in (("bf16-mixed", "bf16-mixed"), ("32-true", "32-true"), (None, "32-true")):
        trainer = RLFlowTrainer(accelerator="cpu", devices=1, precision=precision, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False)
        assert trainer.precision == expected
    assert not [r for r in caplog.records if "trainer.precision=auto" in r.message]
