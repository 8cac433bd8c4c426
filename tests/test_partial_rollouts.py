"""Partial rollouts (``data.partial_rollouts``): a completion interrupted by a weight update continues under the new
weights from its KV cache, each token stamped with the version that sampled it.

Every log-prob is checked against a plain recomputation with transformers' own forward: the tokens sampled before
the swap against a full forward of the old weights, those after it against the new weights' forward continuing
from the old weights' cache of the prefix (what "keeping the KV cache" computes), which differs from both a full
forward of the old and of the new weights.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import ROOT
from resume_helpers import TIMINGS, assert_same_final_state, assert_same_run, metrics_by_step, run_args, trajectories
from test_pipeline import kill_mid_step
from tiny_archs import IdTokenizer, tiny_causal_lm
from transformers import DynamicCache

from rlflow.cli import cli_main
from rlflow.config_error import ConfigError
from rlflow.rollout.base import SamplingParams
from rlflow.rollout.engine import EngineRollout
from rlflow.rollout.engine_support import cache_kwargs
from rlflow.rollout.pipeline import group_versions, make_pipeline
from rlflow.rollout.process import JobResult

TESTS = ROOT / "tests"


def swapped_logprobs(old, new, prompt: list[int], tokens: list[int], versions: list[int],
                     old_version: int) -> torch.Tensor:
    """log p(token | prefix) of a completion whose tokens from index ``m`` on (the first not of ``old_version``)
    were sampled by ``new`` on the cache ``old`` built for the prompt and the tokens before ``m - 1`` (the token fed
    at the first new step is fed through ``new``)."""
    m = versions.count(old_version)
    assert versions == sorted(versions) and versions[:m] == [old_version] * m
    ids = torch.tensor([prompt + tokens])
    p = len(prompt)
    with torch.no_grad():
        logp_old = torch.log_softmax(old(input_ids=ids).logits[0, p - 1: -1].float(), -1)
        out = logp_old.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        if m == len(tokens):
            return out
        if m == 0:  # admitted after the swap: all new
            logp_new = torch.log_softmax(new(input_ids=ids).logits[0, p - 1: -1].float(), -1)
            return logp_new.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        cache = DynamicCache(config=old.config)
        old(input_ids=torch.tensor([prompt + tokens[: m - 1]]), use_cache=True, **cache_kwargs(old, cache))
        rest = tokens[m - 1:]
        positions = torch.arange(p + m - 1, p + len(tokens))[None]
        logits = new(input_ids=torch.tensor([rest]), position_ids=positions, use_cache=True,
                     **cache_kwargs(new, cache)).logits[0, :-1].float()
        tail = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[m:])[:, None])[:, 0]
        return torch.cat([out[:m], tail])


def plain(model, prompt, tokens) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1: -1].float(), -1)
    return logp.gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("fused", [True, False])
def test_a_swap_mid_decode_continues_rows_under_the_new_weights_from_their_caches(fused):
    torch.manual_seed(0)
    old = tiny_causal_lm("qwen3", seed=0)
    new = tiny_causal_lm("qwen3", seed=1)  # other weights of the same architecture
    live = copy.deepcopy(old)
    engine = EngineRollout(seed=0, fused=fused, min_shared_prefix=0, max_batch_size=6, prefill_batch_size=1)
    engine.bind(live, IdTokenizer())
    swap_at = 4
    calls = []

    def hook(iteration: int) -> bool:
        calls.append(iteration)
        if iteration != swap_at:
            return False
        live.load_state_dict(new.state_dict())
        engine.version = 7
        return True

    engine.step_hook, engine.version = hook, 3
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]  # 3 prompts x 3 rows, room for 6: one joins late
    groups = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=10, stop_token_ids=[]), n=3)
    assert calls[: swap_at + 1] == list(range(swap_at + 1))
    kinds = set()
    for prompt, group in zip(prompts, groups):
        for c in group:
            v = c.token_versions
            assert len(v) == len(c.token_ids) == 10 and v == sorted(v) and set(v) <= {3, 7}
            expected = swapped_logprobs(old, new, prompt, c.token_ids, v, 3)
            assert torch.allclose(torch.tensor(c.logprobs), expected, atol=2e-4)
            m = v.count(3)
            kinds.add("mixed" if 0 < m < len(v) else "new" if m == 0 else "old")
            if 1 < m < len(v):  # the kept cache matters: neither weights' full forward gives these log-probs
                assert not torch.allclose(torch.tensor(c.logprobs[m:]), plain(new, prompt, c.token_ids)[m:], atol=1e-3)
                assert not torch.allclose(torch.tensor(c.logprobs[m:]), plain(old, prompt, c.token_ids)[m:], atol=1e-3)
    assert kinds == {"mixed", "new"}  # the first two groups straddle the swap; the third joined after it
    # iteration 0 admits group 0 (its first token), 1 admits group 1 (its first; group 0 waits), 2 and 3 decode
    # both: 3 tokens each before the swap at iteration 4; group 2 joins when group 0 and 1 finish
    for c in groups[0] + groups[1]:
        assert c.token_versions == [3] * 3 + [7] * 7


def test_the_oldest_token_bounds_a_groups_staleness():
    groups = [[([1, 2, 3], [0.0] * 3, "length", [4, 4, 5]), ([1], [0.0], "stop", [4])],
              [([1, 2], [0.0] * 2, "length", [5, 5]), ([3], [0.0], "stop", [5])],
              [([1], [0.0], "stop", None)]]
    result = JobResult(step=3, version=4, prompts=[[1], [2], [3]], groups=groups, seconds=0.0, swapped_to=5)
    assert group_versions(result) == [4, 5, 4]  # oldest token; the job's version without stamps
    assert JobResult.from_state(result.to_state()) == result


def test_partial_rollouts_need_pipelining_the_engine_and_one_process():
    from types import SimpleNamespace

    from rlflow.rollout.hf import HFRollout
    from rlflow.rollout.pipeline import check_partial

    with pytest.raises(ConfigError, match="data.partial_rollouts .* needs data.max_staleness >= 1"):
        make_pipeline(0, "regenerate", 1, 0, partial_rollouts=True)
    with pytest.raises(ConfigError, match="data.partial_swap_step"):
        make_pipeline(1, "regenerate", 1, 0, partial_rollouts=True, partial_swap_step=-1)
    with pytest.raises(ConfigError, match="needs the engine rollout backend.*HFRollout"):
        check_partial(SimpleNamespace(backend=HFRollout(), world_size=1))
    with pytest.raises(ConfigError, match="not supported with 2 ranks"):
        check_partial(SimpleNamespace(backend=EngineRollout(), world_size=2))
    check_partial(SimpleNamespace(backend=EngineRollout(), world_size=1))


# --------------------------------------------------------------------------------------- end to end
STEPS = 4
PARTIAL = ("--data.max_staleness=1", "--data.partial_rollouts=true", "--data.partial_swap_step=5")


@pytest.fixture(scope="module")
def partial_run(tiny_model, small_data, tmp_path_factory):
    from test_pipeline import Recorder

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("partial")
    cli = cli_main(run_args(tiny_model, small_data, root, *PARTIAL, steps=STEPS)[1:], run=False)
    recorder = Recorder()
    cli.trainer.callbacks.append(recorder)
    cli.trainer.fit(cli.model, cli.datamodule)
    return cli, recorder, root


@pytest.mark.slow
def test_stamps_logprobs_bound_and_correction_of_a_partial_run(partial_run, tiny_model):
    from test_pipeline import model_at

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
    from test_pipeline import Recorder

    cli = cli_main(run_args(tiny_model, small_data, tmp_path, *PARTIAL, steps=STEPS)[1:], run=False)
    rec = Recorder(slow_trainer=1.0)
    cli.trainer.callbacks.append(rec)
    cli.trainer.fit(cli.model, cli.datamodule)
    base = partial_run[1]
    for step in range(STEPS):
        assert rec.metrics[step]["sampling/staleness/max"] <= 1
        for key in base.metrics[step].keys() - TIMINGS:
            assert rec.metrics[step][key] == base.metrics[step][key], (step, key)
        assert [e.token_versions for e in rec.experiences[step]] == [e.token_versions for e in base.experiences[step]]


@pytest.mark.slow
def test_kill_and_resume_of_a_partial_run_matches_the_straight_run(tiny_model, small_data, tmp_path, one_thread):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    extra = ("--model.optimizer_steps=2", "--data.max_staleness=2", "--data.partial_rollouts=true",
             "--data.partial_swap_step=5")
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
