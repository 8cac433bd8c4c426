"""Partial rollouts (``data.pipeline.partial_rollouts``): a completion interrupted by a weight update continues under
the new
weights from its KV cache, each token stamped with the version that sampled it.

Every log-prob is checked against a plain recomputation with transformers' own forward: the tokens sampled before
the swap against a full forward of the old weights, those after it against the new weights' forward continuing
from the old weights' cache of the prefix (what "keeping the KV cache" computes), which differs from both a full
forward of the old and of the new weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

from rlflow.config_error import ConfigError
from rlflow.data.settings import PipelineSettings
from rlflow.rollout.base import SamplingParams
from rlflow.rollout.engine import EngineRollout
from rlflow.rollout.engine_support import cache_kwargs
from rlflow.rollout.pipeline import group_versions, make_pipeline
from rlflow.rollout.process import JobResult
from tests.helpers.paths import ROOT
from tests.helpers.tiny_archs import IdTokenizer, tiny_causal_lm

TESTS = ROOT / "tests"


def swapped_logprobs(
    old, new, prompt: list[int], tokens: list[int], versions: list[int], old_version: int
) -> torch.Tensor:
    """log p(token | prefix) of a completion whose tokens from index ``m`` on (the first not of ``old_version``)
    were sampled by ``new`` on the cache ``old`` built for the prompt and the tokens before ``m - 1`` (the token fed
    at the first new step is fed through ``new``)."""
    m = versions.count(old_version)
    assert versions == sorted(versions) and versions[:m] == [old_version] * m
    ids = torch.tensor([prompt + tokens])
    p = len(prompt)
    with torch.no_grad():
        logp_old = torch.log_softmax(old(input_ids=ids).logits[0, p - 1 : -1].float(), -1)
        out = logp_old.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        if m == len(tokens):
            return out
        if m == 0:  # admitted after the swap: all new
            logp_new = torch.log_softmax(new(input_ids=ids).logits[0, p - 1 : -1].float(), -1)
            return logp_new.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        cache = DynamicCache(config=old.config)
        old(input_ids=torch.tensor([prompt + tokens[: m - 1]]), use_cache=True, **cache_kwargs(old, cache))
        rest = tokens[m - 1 :]
        positions = torch.arange(p + m - 1, p + len(tokens))[None]
        logits = (
            new(input_ids=torch.tensor([rest]), position_ids=positions, use_cache=True, **cache_kwargs(new, cache))
            .logits[0, :-1]
            .float()
        )
        tail = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens[m:])[:, None])[:, 0]
        return torch.cat([out[:m], tail])


def plain(model, prompt, tokens) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float(), -1)
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
    groups = [
        [([1, 2, 3], [0.0] * 3, "length", [4, 4, 5]), ([1], [0.0], "stop", [4])],
        [([1, 2], [0.0] * 2, "length", [5, 5]), ([3], [0.0], "stop", [5])],
        [([1], [0.0], "stop", None)],
    ]
    result = JobResult(step=3, version=4, prompts=[[1], [2], [3]], groups=groups, seconds=0.0, swapped_to=5)
    assert group_versions(result) == [4, 5, 4]  # oldest token; the job's version without stamps
    assert JobResult.from_state(result.to_state()) == result


def test_partial_rollouts_need_pipelining_the_engine_and_one_process():

    from rlflow.rollout.hf import HFRollout
    from rlflow.rollout.pipeline import check_partial

    with pytest.raises(ConfigError, match="data.pipeline.partial_rollouts .* needs data.pipeline.max_staleness >= 1"):
        make_pipeline(PipelineSettings(partial_rollouts=True), seed=0)
    with pytest.raises(ConfigError, match="data.pipeline.partial_swap_step"):
        PipelineSettings(max_staleness=1, partial_rollouts=True, partial_swap_step=-1)
    with pytest.raises(ConfigError, match="needs the engine rollout backend.*HFRollout"):
        check_partial(HFRollout(), 1)
    with pytest.raises(ConfigError, match="not supported with 2 ranks"):
        check_partial(EngineRollout(), 2)
    check_partial(EngineRollout(), 1)
