"""The benchmarks' ``model.generate`` anchor (:class:`benchmarks.plain_generate.PlainGenerateRollout`) samples with
transformers' own warpers: the same tempered top-k and min-p distributions as rlflow's per-row sampler, drawn from
torch's global generator."""

from __future__ import annotations

import pytest
import torch

from benchmarks.plain_generate import PlainGenerateRollout
from rlflow.rollout.base import SamplingParams
from rlflow.rollout.hf import HFRollout
from tests.helpers.multiturn_helpers import qwen3_char_tokenizer, tiny_model
from tests.unit.rollout.test_hf_rollout import prompt, tempered_top_k


@pytest.fixture(scope="module")
def tok():
    return qwen3_char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    m = tiny_model(len(tok), seed=2)
    with torch.no_grad():
        m.lm_head.weight.mul_(8.0)  # a peaked next-token distribution, so tempering and truncation matter
    return m


def test_the_benchmarks_plain_generate_anchor_samples_with_transformers_own_warpers(tok, model, one_thread):
    """PlainGenerateRollout (benchmarks/bench_rollout.py's anchor) samples with generate's own top-k warper and torch's
    global generator: the same tempered top-k distribution, different draws than the per-row streams."""
    ids = prompt(tok, "Hello there")
    temperature, k, n = 0.7, 4, 3000
    tempered, top, expected = tempered_top_k(model, ids, temperature, k)
    params = SamplingParams(temperature=temperature, top_k=k, max_tokens=1)
    anchor = PlainGenerateRollout(batch_size=1000)
    anchor.bind(model, tok)
    torch.manual_seed(0)
    (group,) = anchor.generate([ids], params, n=n)
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in group]), minlength=len(tok)).double() / n
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(top.tolist())
    assert (counts - expected).abs().max() < 0.03
    torch.manual_seed(0)
    (again,) = anchor.generate([ids], params, n=n)
    assert [c.token_ids for c in again] == [c.token_ids for c in group]  # torch's global generator decides
    rows = HFRollout(seed=5, batch_size=1000)
    rows.bind(model, tok)
    (own,) = rows.generate([ids], params, n=n)
    assert [c.token_ids for c in own] != [c.token_ids for c in group]


@pytest.mark.parametrize("backend", ["rows", "plain"])
def test_min_p_keeps_the_tokens_within_min_p_of_the_best_in_both_hf_samplers(tok, model, one_thread, backend):
    """``min_p``: rlflow's per-row sampler and ``generate``'s own MinP warper (the benchmarks' anchor) sample from the
    tokens whose tempered probability is at least ``min_p`` times the best one's, renormalised."""
    ids = prompt(tok, "Hello there")
    temperature, min_p, n = 1.5, 0.2, 3000
    with torch.no_grad():
        tempered = torch.softmax(model(torch.tensor([ids])).logits[0, -1].double() / temperature, dim=-1)
    kept = tempered >= min_p * tempered.max()
    expected = torch.where(kept, tempered, 0.0)
    expected /= expected.sum()
    assert 3 <= int(kept.sum()) and tempered[~kept].sum() > 0.05  # min-p drops a real share of the mass
    hf = HFRollout(seed=5, batch_size=1000) if backend == "rows" else PlainGenerateRollout(batch_size=1000)
    hf.bind(model, tok)
    torch.manual_seed(0)
    (group,) = hf.generate([ids], SamplingParams(temperature=temperature, max_tokens=1, min_p=min_p), n=n)
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in group]), minlength=len(tok)).double() / n
    assert not counts[~kept].any()  # nothing below min_p x the best
    assert (counts - expected).abs().max() < 0.03  # 3000 draws: standard error <= 0.009

