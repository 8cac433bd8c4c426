"""The ``hf`` backend's sampling: ``model.generate`` over rlflow's per-row counter-based draws (RowDrawsSampler).

Checked against an independent computation (the model's next-token logits from a plain forward, tempered and
truncated by hand), and for the property the multi-turn loop relies on: a row samples the same tokens whatever
else is in its ``generate`` batch."""


from __future__ import annotations

import pytest
import torch

from rlflow.rollout.base import SamplingParams
from rlflow.rollout.draws import isolated_draws
from rlflow.rollout.hf import HFRollout
from tests.helpers.multiturn_helpers import qwen3_char_tokenizer, tiny_model


@pytest.fixture(scope="module")
def tok():
    return qwen3_char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    m = tiny_model(len(tok), seed=2)
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)  # a peaked next-token distribution, so tempering and truncation matter
    return m


def prompt(tok, text):
    return tok.encode(text, add_special_tokens=False)


def tempered_top_k(model, ids, temperature, k):
    """The next-token distribution after ``ids`` from a plain forward, tempered, and truncated to the top ``k`` by
    hand: (tempered probabilities, top-k ids, the truncated and renormalised distribution)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double()
    tempered = torch.softmax(logits / temperature, dim=-1)
    top = torch.topk(tempered, k).indices
    expected = torch.zeros_like(tempered)
    expected[top] = tempered[top] / tempered[top].sum()
    return tempered, top, expected


def test_first_tokens_follow_the_tempered_top_k_distribution_and_logprobs_are_untruncated(tok, model, one_thread):
    ids = prompt(tok, "Hello there")
    temperature, k, n = 0.7, 4, 3000
    tempered, top, expected = tempered_top_k(model, ids, temperature, k)
    assert expected[top].max() < 0.6 and tempered[top].sum() < 0.5  # the truncation changes the distribution a lot
    hf = HFRollout(seed=5, batch_size=1000)
    hf.bind(model, tok)
    (group,) = hf.generate([ids], SamplingParams(temperature=temperature, top_k=k, max_tokens=1), n=n)
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in group]), minlength=len(tok)).double() / n
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(top.tolist())  # nothing outside the top k
    assert (counts - expected).abs().max() < 0.03  # 3000 draws: standard error <= 0.009
    # the behaviour log-prob: log_softmax(logits / T) of the taken token, before the top-k truncation
    for c in group[:50]:
        assert c.logprobs[0] == pytest.approx(torch.log(tempered[c.token_ids[0]]).item(), abs=1e-4)


def test_a_row_samples_the_same_alone_or_in_a_bigger_padded_batch(tok, model, one_thread):
    params = SamplingParams(temperature=1.0, max_tokens=12)
    a, b = prompt(tok, "Short."), prompt(tok, "A much longer prompt, padded differently.")

    def run(prompts, seed, batch_size=256):
        hf = HFRollout(seed=seed, batch_size=batch_size)
        hf.bind(model, tok)
        return hf.generate(prompts, params, n=3)

    alone = run([a], seed=1)[0]
    together = run([a, b], seed=1, batch_size=4)  # a's rows share a batch with b's (different left padding)
    assert [c.token_ids for c in alone] == [c.token_ids for c in together[0]]
    for x, y in zip(alone, together[0]):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    assert len({tuple(c.token_ids) for c in alone}) == 3  # each sample its own stream
    assert [c.token_ids for c in run([a], seed=2)[0]] != [c.token_ids for c in alone]


def test_seeded_draws_continue_from_the_saved_state_and_evaluation_sets_them_aside(tok, model, one_thread):
    params = SamplingParams(temperature=1.0, max_tokens=8)
    ids = [prompt(tok, "Go.")]
    hf = HFRollout(seed=3)
    hf.bind(model, tok)
    hf.generate(ids, params, n=2)
    state = hf.rng_state()
    assert state == {"seed": 3, "calls": 1}
    second = hf.generate(ids, params, n=2)
    resumed = HFRollout(seed=3)
    resumed.bind(model, tok)
    resumed.load_rng_state(state)
    assert [c.token_ids for c in resumed.generate(ids, params, n=2)[0]] == [c.token_ids for c in second[0]]
    with isolated_draws(hf, seed=99):  # an evaluation: its own draws, then training's continue where they were
        hf.generate(ids, params, n=2)
    assert hf.rng_state() == {"seed": 3, "calls": 2}
    unseeded = HFRollout()
    unseeded.bind(model, tok)
    torch.manual_seed(0)
    x = unseeded.generate(ids, params, n=2)
    torch.manual_seed(0)
    assert unseeded.generate(ids, params, n=2) == x  # without a seed, torch's global generator keys each call

