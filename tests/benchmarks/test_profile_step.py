"""benchmarks/profile_step.py on a real (tiny) ``rlflow fit``: every phase of a step is timed, the phases nest as
they should, a config without a reference or several updates runs no old/reference log-prob pass, and the tool
puts rlflow's classes back as it found them."""

from __future__ import annotations

import pytest

from benchmarks import profile_step
from tests.helpers.paths import ROOT


@pytest.mark.slow
def test_profile_times_each_phase_of_the_demo_config_and_restores_the_classes(tiny_model, tiny_data, one_thread,
                                                                               capsys):
    from rlflow.data.datamodule import RolloutDataModule
    from rlflow.losses.clipped import BNPOLoss
    from rlflow.training.module import GRPOModule

    def wrapped_now():
        return ({name: GRPOModule.__dict__.get(name) for name in
                 ("training_step", "logprobs_of", "manual_backward", "fill_logprobs", "on_train_batch_start")},
                RolloutDataModule.__dict__["make_experience"], BNPOLoss.__dict__.get("__call__"))

    before = wrapped_now()
    profile = profile_step.main([
        "--config", str(ROOT / "configs" / "demo_cpu.yaml"), "--steps", "4", "--warmup", "1",
        f"--model.model_path={tiny_model}", f"--data.train_data_path={tiny_data / 'train.jsonl'}",
        "--data.global_batch_size=4", "--data.prompt_repeat_k=4", "--data.sampling.max_tokens=12",
    ])
    wall = profile.wall
    steps = wall["training_step"]
    assert sorted(steps) == [1, 2, 3]  # the warm-up step left out
    rollout, forward = wall["rollout: generate + judge (make_experience)"], wall["training forward (logprobs_of)"]
    collate, backward = wall["  of which collation (collate_packed)"], wall["backward (manual_backward)"]
    for phase in (rollout, forward, collate, backward, wall["loss"], wall["optimizer.step + lr schedule"],
                  wall["Lightning log_dict"]):
        assert sorted(phase) == [1, 2, 3] and all(t > 0 for t in phase.values())
    for step, total in steps.items():
        assert collate[step] < forward[step]  # collation is part of the forward phase
        assert rollout[step] + forward[step] + backward[step] < total  # the phases are parts of the step
    assert "old/ref log-probs (fill_logprobs)" not in wall  # kl_coef 0, one update per rollout: no extra pass
    assert len(profile.loop) == 2  # from one timed step's start to the next
    out = capsys.readouterr().out
    assert "training_step (what bench_step.py times)" in out and "1 torch thread(s)" in out
    assert wrapped_now() == before  # nothing left wrapped for the rest of the session
