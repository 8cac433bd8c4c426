"""The trainer's own rollout backend follows every weight update in a pipelined run (``data.pipeline.max_staleness``).

A pipelined run generates its training rollouts in the generator process, but evaluation, the first step and a
regeneration run on the trainer's engine, whose fused decoder keeps copies of the weights across calls. Its
completions are checked against a plain recomputation: a full forward of the tiny model with the weights of the
moment (snapshotted when the engine was called), not against anything the run computed.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from rlflow.cli import cli_main
from rlflow.rollout.base import SamplingParams
from rlflow.rollout.engine import EngineRollout
from tests.helpers.resume_helpers import run_args
from tests.integration.test_pipeline import OwnWeightsEngine

pytestmark = pytest.mark.slow


def plain_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log p(completion token | prefix) at temperature 1, from one full forward."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits[len(prompt) - 1: -1], dim=-1)
    return logp.gather(1, torch.tensor(completion)[:, None])[:, 0]


def model_at(tiny_model, weights):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    model.load_state_dict(weights)
    return model


def assert_sampled_from(model, prompts, groups) -> None:
    """Every completion's log-probs are those ``model``'s weights give (the engine decoded from them)."""
    for prompt, group in zip(prompts, groups):
        for c in group:
            expected = plain_logprobs(model, list(prompt), list(c.token_ids))
            assert torch.allclose(torch.tensor(c.logprobs), expected, atol=2e-4), (expected - torch.tensor(c.logprobs))


def evaluate_pipelined(tiny_model, small_data, root, *extra):
    """A 2-step pipelined fit evaluating after each step; the trainer's engine calls during evaluation (on the
    trainer's thread: a server backend's training jobs run on the pipeline's), each with the weights it decoded
    and the policy's at the time."""
    args = run_args(tiny_model, small_data, root, "--data.pipeline.max_staleness=1", "--evaluate_every_n_steps=1",
                    f"--data.eval_data_path={small_data / 'val.jsonl'}", "--data.eval.temperature=1.0", *extra,
                    steps=2)
    cli = cli_main(args[1:], run=False)
    calls = []
    generate = EngineRollout.generate

    def recording(backend, prompts, params, n=1, progress=None):
        groups = generate(backend, prompts, params, n, progress)
        if cli.trainer.validating and threading.current_thread() is threading.main_thread():
            calls.append((copy.deepcopy(backend.model.state_dict()), cli.model.policy_version, prompts, groups,
                          copy.deepcopy(cli.model.policy.state_dict())))
        return groups

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EngineRollout, "generate", recording)
        try:
            cli.trainer.fit(cli.model, cli.datamodule)
        finally:
            torch.set_num_threads(threads)
    return cli, calls


@pytest.fixture(scope="module")
def evaluated(tiny_model, small_data, tmp_path_factory):
    return evaluate_pipelined(tiny_model, small_data, tmp_path_factory.mktemp("pipelined_eval"))


def test_evaluation_in_a_pipelined_run_decodes_the_current_weights(evaluated, tiny_model):
    cli, calls = evaluated
    assert isinstance(cli.datamodule.backend, EngineRollout) and cli.datamodule.pipeline is not None
    assert [version for _, version, _, _, _ in calls] == [1, 2]  # after each rollout step's optimizer step
    for weights, _, prompts, groups, _ in calls:
        assert_sampled_from(model_at(tiny_model, weights), prompts, groups)


def test_generations_in_the_trainer_after_updates_decode_the_current_weights(evaluated, tiny_model):
    """A batch the pipeline generates in the trainer process (a regeneration, a resume without completions in
    flight) after the run's updates: the final weights, not those the engine decoded at step 0."""
    cli, _ = evaluated
    pipeline = cli.datamodule.pipeline
    prompts = [r.prompt_ids for r in cli.datamodule.train_records[:2]]
    params = SamplingParams(1.0, 1.0, 0, 8)
    result = pipeline._generate_here(cli.model.policy_version, 5, prompts, params, 2)
    final = model_at(tiny_model, cli.model.policy.state_dict())
    assert_sampled_from(final, prompts, result.completions())


def test_evaluation_on_a_server_shared_with_the_pipelines_thread_decodes_the_current_weights(
        tiny_model, small_data, tmp_path):
    """A backend with weights of its own (an inference server, as lmdeploy's): the pipeline pushes the updates to
    it before evaluation, after the job running on it ends, instead of evaluating the weights of the last push."""
    cli, calls = evaluate_pipelined(tiny_model, small_data, tmp_path,
                                    '--data.rollout={"class_path": "tests.integration.test_pipeline.OwnWeightsEngine"}')
    assert isinstance(cli.datamodule.backend, OwnWeightsEngine)
    assert sorted({version for _, version, _, _, _ in calls}) == [1, 2]
    for decoded, _, prompts, groups, policy in calls:
        assert all(torch.equal(decoded[name], policy[name]) for name in policy)
        assert_sampled_from(model_at(tiny_model, policy), prompts, groups)
    assert cli.model.trained_versions == [(0, 0), (1, 0)]  # the job evaluation waited for trained at its step
