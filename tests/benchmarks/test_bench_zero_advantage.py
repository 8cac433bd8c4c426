"""benchmarks/bench_zero_advantage.py on a real (tiny) ``rlflow fit``: the shares of zero-advantage groups it sets
are the sequences the option leaves out of the backward pass, and the tool puts rlflow's classes back."""

from __future__ import annotations

import pytest

from benchmarks import bench_zero_advantage
from tests.helpers.paths import ROOT


@pytest.mark.slow
def test_the_shares_set_are_the_sequences_left_out(tiny_model, tiny_data, one_thread, capsys):
    from rlflow.data.datamodule import RolloutDataModule
    from rlflow.training.module import PolicyUpdate

    before = (RolloutDataModule.minibatches, PolicyUpdate.run, PolicyUpdate.micro_step)
    results = bench_zero_advantage.main([
        "--config", str(ROOT / "configs" / "demo_cpu.yaml"), "--steps", "3", "--shares", "0.5", "1.0",
        f"--model.model_path={tiny_model}", f"--data.train_data_path={tiny_data / 'train.jsonl'}",
        "--data.global_batch_size=4", "--data.prompt_repeat_k=4", "--data.sampling.max_tokens=12",
    ])
    (half, half_off, half_on), (whole, whole_off, whole_on) = results
    assert (half, whole) == (0.5, 1.0)
    assert half_off["backward"] == whole_off["backward"] == 16  # off: every sequence goes backward
    assert half_on["backward"] == 8 and whole_on["backward"] == 1  # on: two of four groups; nothing but the shortest
    assert half_off["forward_only"] == 0 and half_on["forward_only"] > 0 and whole_on["forward_only"] > 0
    assert all(r[k] > 0 for r in (half_off, half_on, whole_off, whole_on) for k in ("update", "step"))
    out = capsys.readouterr().out
    assert "zero-advantage share" in out and "16 / 8" in out and "16 / 1" in out
    assert (RolloutDataModule.minibatches, PolicyUpdate.run, PolicyUpdate.micro_step) == before
