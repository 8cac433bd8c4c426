"""The engine's ``split_stragglers``: the last rows of a mostly finished group continue as groups of one, sampling
what they would have sampled in their group, with log-probs of the model's own forward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlflow.rollout.base import SamplingParams
from rlflow.rollout.engine import EngineRollout
from rlflow.rollout.serving import ServeCall
from tests.unit.rollout.test_engine import assert_logprobs_match_a_full_forward, prompts_of

#: sampled with these stop tokens, the tiny model's rows end at spread lengths: groups are left with stragglers
STOPS = [6, 7, 8]


@pytest.fixture(scope="module")
def model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()


def run(model, tokenizer, params: SamplingParams, n: int, split: bool, **kwargs):
    engine = EngineRollout(seed=0, split_stragglers=split, **kwargs)
    engine.bind(model, tokenizer)
    return engine, engine.generate(prompts_of([5, 30, 12, 9], seed=1), params, n=n)


def tokens_of(groups):
    return [[c.token_ids for c in g] for g in groups]


@pytest.mark.parametrize("penalty", [1.0, 1.3])
@pytest.mark.parametrize("kwargs", [{}, {"max_batch_size": 16, "prefill_batch_size": 1}])  # groups join mid-run
def test_stragglers_continue_alone_and_sample_what_they_would_have_in_their_group(model, tokenizer, penalty,
                                                                                  kwargs):
    params = SamplingParams(1.0, 1.0, 0, max_tokens=40, stop_token_ids=STOPS, repetition_penalty=penalty)
    split, got = run(model, tokenizer, params, 8, True, **kwargs)
    plain, want = run(model, tokenizer, params, 8, False, **kwargs)
    assert split.split_rows > 0 and plain.split_rows == 0
    assert tokens_of(got) == tokens_of(want)  # each row's draws are its own
    for g_group, w_group in zip(got, want):
        for g, w in zip(g_group, w_group):
            assert g.finish_reason == w.finish_reason
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=2e-5, rtol=0)
    if penalty == 1.0:  # the log-probs of the moved rows are the model's own (the penalty changes the logits)
        assert_logprobs_match_a_full_forward(model, prompts_of([5, 30, 12, 9], seed=1), got, temperature=1.0)


def test_a_group_with_more_rows_left_or_of_fewer_than_four_stays_whole(model, tokenizer, monkeypatch):
    params = SamplingParams(1.0, 1.0, 0, max_tokens=40, stop_token_ids=STOPS)
    engine, groups = run(model, tokenizer, params, 3, True)
    assert engine.split_rows == 0 and len(groups) == 4  # n = 3: never split
    moves = []  # (rows of the group still running, rows moved) at each move
    move = ServeCall._move_to_singles

    def recorded(self, lane, first, live):
        moves.append((sum(r.alive for r in lane.rows[first: first + lane.state.n]), len(live)))
        move(self, lane, first, live)

    monkeypatch.setattr(ServeCall, "_move_to_singles", recorded)
    engine, groups = run(model, tokenizer, params, 8, True)
    assert moves and all(running == moved and 1 <= moved <= 8 // 4 for running, moved in moves)
    assert engine.split_rows == sum(moved for _, moved in moves) and [len(g) for g in groups] == [8] * 4


def test_no_row_moves_inside_keep_caches(model, tokenizer, monkeypatch):
    params = SamplingParams(1.0, 1.0, 0, max_tokens=40, stop_token_ids=STOPS)
    engine = EngineRollout(seed=0)
    engine.bind(model, tokenizer)
    calls = []
    monkeypatch.setattr(ServeCall, "split_stragglers", lambda self: calls.append(1))
    with engine.keep_caches():  # the hand-back keeps each row's cache, read from its group
        engine.generate(prompts_of([5, 30], seed=1), params, n=8)
    assert not calls
    engine.generate(prompts_of([5, 30], seed=1), params, n=8)
    assert calls
