"""Partial rollouts (``data.pipeline.partial_rollouts``) in ``rlflow fit``: the stamps, log-probs, staleness bound and
correction of a partial run, a slow trainer changes nothing, and kill-and-resume matches the straight run.

Every log-prob is checked against a plain recomputation with transformers' own forward."""

from __future__ import annotations

import json

import pytest
import torch

from rlflow.cli import cli_main
from tests.helpers.resume_helpers import (
    MEASURED,
    assert_same_final_state,
    assert_same_run,
    metrics_by_step,
    run_args,
    trajectories,
)
from tests.integration.test_pipeline import kill_mid_step
from tests.unit.rollout.test_partial_rollouts import plain, swapped_logprobs

# --------------------------------------------------------------------------------------- end to end
STEPS = 4
PARTIAL = (
    "--data.pipeline.max_staleness=1",
    "--data.pipeline.partial_rollouts=true",
    "--data.pipeline.partial_swap_step=5",
)


@pytest.fixture(scope="module")
def partial_run(tiny_model, small_data, tmp_path_factory):
    from tests.integration.test_pipeline import Recorder

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("partial")
    cli = cli_main(run_args(tiny_model, small_data, root, *PARTIAL, steps=STEPS)[1:], run=False)
    recorder = Recorder()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli, recorder, root


@pytest.mark.slow
def test_stamps_logprobs_bound_and_correction_of_a_partial_run(partial_run, tiny_model):
    from tests.integration.test_pipeline import model_at

    cli, rec, root = partial_run
    models = [model_at(tiny_model, w) for w in rec.weights]
    rows = {(r["step"], r["group"], i % 4): r for i, r in enumerate(trajectories(root))}
    mixed = 0
    for step in range(1, STEPS):
        m = rec.metrics[step]
        assert m["sampling/staleness/max"] == 1.0  # the oldest token's: within max_staleness 1
        assert 0.0 < m["sampling/staleness/token_mean"] < 1.0  # later tokens were sampled by the trained version
        weights = []
        for i, e in enumerate(rec.experiences[step]):
            v = e.token_versions
            assert v is not None and len(v) == len(e.completion_ids) and set(v) <= {step - 1, step}
            assert v == sorted(v) and e.policy_version == min(v)
            assert v[: min(5, len(v))] == [step - 1] * min(5, len(v))  # swap before decode iteration 5
            mixed += len(set(v)) > 1
            behaviour = swapped_logprobs(models[step - 1], models[step], e.prompt_ids, e.completion_ids, v, step - 1)
            assert torch.allclose(torch.tensor(e.rollout_logprobs), behaviour, atol=2e-4), step
            # the correction's weights: step-start weights (version `step`) over the per-token behaviour log-probs
            weights.append(torch.exp(plain(models[step], e.prompt_ids, e.completion_ids) - behaviour).clamp(max=2.0))
            assert rows[(step, e.group, i % 4)]["token_versions"] == v  # carried into trajectories.jsonl
        w = torch.cat(weights)
        assert m["sampling/importance_sampling_ratio/mean"] == pytest.approx(w.mean().item(), abs=1e-4)
        assert m["sampling/importance_sampling_ratio/min"] == pytest.approx(w.min().item(), abs=1e-4)
    assert mixed > 0
    assert all(e.token_versions is None for e in rec.experiences[0])  # step 0: generated in the trainer, on-policy


@pytest.mark.slow
def test_a_slow_trainer_changes_nothing_in_a_partial_run(partial_run, tiny_model, small_data, tmp_path):
    """The swap waits for the version it expects at a fixed decode iteration: a trainer 1 s slower on every other
    step gives the same run, metric for metric."""
    from tests.integration.test_pipeline import Recorder

    cli = cli_main(run_args(tiny_model, small_data, tmp_path, *PARTIAL, steps=STEPS)[1:], run=False)
    rec = Recorder(slow_trainer=1.0)
    cli.trainer.callbacks.append(rec)
    cli.trainer.fit(cli.model, cli.datamodule)
    base = partial_run[1]
    for step in range(STEPS):
        assert rec.metrics[step]["sampling/staleness/max"] <= 1
        for key in base.metrics[step].keys() - MEASURED:
            assert rec.metrics[step][key] == base.metrics[step][key], (step, key)
        assert [e.token_versions for e in rec.experiences[step]] == [e.token_versions for e in base.experiences[step]]


@pytest.mark.slow
def test_kill_and_resume_of_a_partial_run_matches_the_straight_run(tiny_model, small_data, tmp_path, one_thread):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    extra = (
        "--model.update.optimizer_steps=2",
        "--data.pipeline.max_staleness=2",
        "--data.pipeline.partial_rollouts=true",
        "--data.pipeline.partial_swap_step=5",
    )
    cli_main(run_args(tiny_model, small_data, straight, *extra))
    state = kill_mid_step(tiny_model, small_data, killed, tmp_path / "generator.pid", extra)
    in_flight = state["RolloutDataModule"]["pipeline"]["in_flight"]
    # step 3's samples: started from version 4, swapped to version 6 (the weights of the checkpoint) mid-way
    assert (in_flight["step"], in_flight["version"], in_flight["swapped_to"]) == (3, 4, 6)
    cli = cli_main(run_args(tiny_model, small_data, killed, *extra, "--ckpt_path=last"))
    assert cli.trainer.global_step == 6
    assert_same_run(straight, killed, 6)
    rows = [r for r in trajectories(straight) if r["step"] == 4]
    assert {v for r in rows for v in r["token_versions"]} == {6, 8}
    assert_same_final_state(straight, killed, 6)
    assert json.dumps(trajectories(straight)) == json.dumps(trajectories(killed))
    assert max(metrics_by_step(killed)[s]["sampling/staleness/max"] for s in range(6)) <= 2
