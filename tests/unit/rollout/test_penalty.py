"""``data.sampling.repetition_penalty`` (:mod:`rlflow.rollout.penalty`): the penalty against transformers'
``RepetitionPenaltyLogitsProcessor``; the engine's and the ``hf`` backend's log-probs against a plain recomputation
(one full forward per completion, the penalty applied by transformers' processor to the prompt and the tokens so
far, then the temperature), through admissions in several waves, compaction and left padding; greedy decoding
over the penalised logits; the setting's validation."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import RepetitionPenaltyLogitsProcessor

from rlflow.config_error import ConfigError
from rlflow.rollout.base import SamplingParams, SamplingSettings
from rlflow.rollout.engine import EngineRollout
from rlflow.rollout.hf import HFRollout
from rlflow.rollout.penalty import penalize, seen_tokens
from rlflow.rollout.requests import DecodeRequest, ListSource
from tests.helpers.tiny_archs import IdTokenizer, tiny_causal_lm


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 40) for _ in range(n)] for n in lengths]  # a narrow id range: repeats are common


@pytest.mark.parametrize("penalty", [0.7, 1.3])
def test_penalize_matches_transformers_processor(penalty):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 20, (4, 9), generator=g)
    logits = torch.randn(4, 50, generator=g) * 3
    want = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    torch.testing.assert_close(penalize(logits, seen_tokens(ids, 50), penalty), want, rtol=0, atol=0)


def test_seen_tokens_counts_presence_and_leaves_out_invalid_positions():
    ids = torch.tensor([[3, 3, 5, 7], [1, 1, 4, 4]])  # row 1 left-padded with id 1 twice
    valid = torch.tensor([[True] * 4, [False, False, True, True]])
    seen = seen_tokens(ids, 8, valid)
    assert seen[0].nonzero().flatten().tolist() == [3, 5, 7]
    assert seen[1].nonzero().flatten().tolist() == [4]  # the padding id 1 is not "seen"
    wide = penalize(torch.ones(2, 10), seen, 2.0)  # a padded vocabulary: columns 8 and 9 were never seen
    assert wide[0].tolist() == [1, 1, 1, 0.5, 1, 0.5, 1, 0.5, 1, 1]


@torch.no_grad()
def recomputed_logprobs(model, prompt: list[int], tokens: list[int], penalty: float, temperature: float):
    """Per completion token: log_softmax(processor(prompt + tokens before it, logits) / T) at the token."""
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1].float()
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    out = []
    for t, token in enumerate(tokens):
        context = torch.tensor([prompt + tokens[:t]])
        scores = processor(context, logits[t: t + 1].clone())
        out.append(torch.log_softmax(scores / temperature, -1)[0, token].item())
    return torch.tensor(out, dtype=torch.float64)


def backend_of(kind: str, model, seed: int = 3):
    backend = EngineRollout(seed=seed, max_batch_size=6, prefill_batch_size=2) if kind == "engine" else HFRollout(
        seed=seed)
    backend.bind(model, IdTokenizer())
    return backend


@pytest.mark.parametrize("kind,arch", [("engine", "qwen3"), ("engine", "llama"), ("hf", "llama")])
def test_rollout_logprobs_are_those_of_the_penalised_distribution(kind, arch):
    """Admitted in waves (a batch of 6 rows, groups of 3), rows finishing at different lengths (a stop token):
    every token's log-prob equals the recomputation, and the penalty changed what was sampled."""
    model = tiny_causal_lm(arch, seed=2)
    prompts = prompts_of([5, 9, 7, 12], seed=1)
    params = SamplingParams(0.8, max_tokens=10, stop_token_ids=[7], repetition_penalty=1.6)
    groups = backend_of(kind, model).generate(prompts, params, n=3)
    lengths = set()
    for prompt, group in zip(prompts, groups):
        for c in group:
            want = recomputed_logprobs(model, prompt, c.token_ids, 1.6, 0.8)
            torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), want, atol=1e-4, rtol=0)
            lengths.add(len(c.token_ids))
    assert len(lengths) > 1  # rows finished apart: compaction and dead rows were exercised
    plain = backend_of(kind, model).generate(prompts, SamplingParams(0.8, max_tokens=10, stop_token_ids=[7]), n=3)
    assert [c.token_ids for g in plain for c in g] != [c.token_ids for g in groups for c in g]
    same = backend_of(kind, model).generate(
        prompts, SamplingParams(0.8, max_tokens=10, stop_token_ids=[7], repetition_penalty=1.0), n=3)
    assert [c.token_ids for g in plain for c in g] == [c.token_ids for g in same for c in g]  # 1.0: no change


def test_engine_lanes_of_different_group_sizes_keep_their_own_tokens():
    """Requests of 3 rows and of 1 row decode in one step as two lanes (a multi-turn rollout's first turn next to
    its later turns); each row's penalty still covers only its own prompt and tokens."""
    model = tiny_causal_lm("qwen3", seed=8)
    prompts = prompts_of([6, 9, 5], seed=9)
    requests = [DecodeRequest(prompts[0], [11, 12, 13], tag=0), DecodeRequest(prompts[1], [21], tag=1),
                DecodeRequest(prompts[2], [31, 32, 33], tag=2)]
    params = SamplingParams(1.0, max_tokens=7, repetition_penalty=1.8)
    engine = backend_of("engine", model)
    served = {request.tag: group for request, group in engine.serve(ListSource(requests), params)}
    assert sorted(served) == [0, 1, 2] and [len(served[i]) for i in range(3)] == [3, 1, 3]
    for i, prompt in enumerate(prompts):
        for c in served[i]:
            want = recomputed_logprobs(model, prompt, c.token_ids, 1.8, 1.0)
            torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), want, atol=1e-4, rtol=0)


def test_engine_and_hf_sample_the_same_tokens_with_a_penalty():
    """Both backends sample each row from the same stream and penalise the same tokens (the hf backend leaves its
    left padding out), so seeded rollouts agree token for token."""
    model = tiny_causal_lm("llama", seed=4)
    prompts = prompts_of([4, 11, 6], seed=5)
    params = SamplingParams(1.0, max_tokens=8, repetition_penalty=1.5)
    a = backend_of("engine", model, seed=9).generate(prompts, params, n=2)
    b = backend_of("hf", model, seed=9).generate(prompts, params, n=2)
    assert [c.token_ids for g in a for c in g] == [c.token_ids for g in b for c in g]


@pytest.mark.parametrize("kind", ["engine", "hf"])
def test_greedy_decoding_takes_the_best_penalised_token(kind):
    model = tiny_causal_lm("qwen3", seed=6)
    prompts = prompts_of([6, 8], seed=7)
    groups = backend_of(kind, model).generate(prompts, SamplingParams(0.0, max_tokens=8, repetition_penalty=3.0), n=1)
    processor = RepetitionPenaltyLogitsProcessor(3.0)
    for prompt, (c,) in zip(prompts, groups):
        for t, token in enumerate(c.token_ids):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + c.token_ids[:t]])).logits[:, -1].float()
            assert int(processor(torch.tensor([prompt + c.token_ids[:t]]), logits).argmax()) == token
        assert len(set(c.token_ids)) > 1  # a strong penalty breaks the tiny model's repeats


def test_bad_penalties_are_refused():
    with pytest.raises(ConfigError, match="repetition_penalty must be > 0"):
        SamplingParams(repetition_penalty=0.0)
    with pytest.raises(ConfigError, match="data.sampling.repetition_penalty must be > 0"):
        SamplingSettings(repetition_penalty=-1.0)


def test_the_datamodule_hands_the_penalty_to_training_rollouts_only(tiny_model, tiny_data):
    from rlflow.data.datamodule import RolloutDataModule

    dm = RolloutDataModule(train_data_path=str(tiny_data / "train.jsonl"), sampling={"repetition_penalty": 1.2})
    assert dm.sampling.repetition_penalty == 1.2 and dm.eval_sampling.repetition_penalty == 1.0
