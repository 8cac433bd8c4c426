"""The sampler (:mod:`rlflow.rollout.sampling`): its two-level inverse CDF and its top-k/top-p/min-p truncation.

What is checked: on vocabularies large enough for two levels (with and without a short last block) it picks the
token a plain sequential float64 CDF picks (``torch.cumsum`` + ``searchsorted``, the sampler's former code) for
every one of thousands of random rows; it never picks a token of zero mass (top-k-like masks, a block of zeros,
``uniform`` 0 and just below 1); its picks follow the probabilities (exact counts over evenly spread uniforms, on a
distribution with a few entries, spread over blocks); top-k -> top-p -> min-p drop exactly what transformers'
warpers drop.
"""

from __future__ import annotations

import pytest
import torch

from rlflow.rollout.base import SamplingParams
from rlflow.rollout.sampling import CDF_BLOCK, inverse_cdf, truncate


def sequential_pick(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The first index whose float64 running sum reaches ``(1 - uniform) * total``: the whole scan."""
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    return torch.searchsorted(cdf, (1.0 - uniform) * cdf[:, -1:]).squeeze(-1)


@pytest.mark.parametrize("vocab", [49152, 5000, 4 * CDF_BLOCK + 1, 101])
@pytest.mark.parametrize("spread", [1.0, 3.0, 8.0])
def test_it_picks_the_token_of_the_whole_sequential_cdf(vocab, spread):
    gen = torch.Generator().manual_seed(vocab + int(spread))
    for _ in range(4):
        probs = torch.log_softmax(torch.randn(64, vocab, generator=gen) * spread, -1).exp()
        uniform = torch.rand(64, 1, generator=gen, dtype=torch.float64)
        assert torch.equal(inverse_cdf(probs, uniform), sequential_pick(probs, uniform))


def test_it_never_picks_a_token_of_zero_mass():
    vocab = 20 * CDF_BLOCK + 77  # a short last block
    gen = torch.Generator().manual_seed(5)
    probs = torch.rand(8, vocab, generator=gen)
    probs[probs < 0.97] = 0.0  # ~3% of tokens keep mass, as after top-k/top-p
    probs[:, 3 * CDF_BLOCK: 7 * CDF_BLOCK] = 0.0  # whole blocks without mass
    probs[:, -1] = 0.0
    probs[0] = 0.0  # row 0: two tokens of tiny mass around one that holds nearly all of it, in the last block
    probs[0, torch.tensor([5, vocab - 3, vocab - 2])] = torch.tensor([1e-30, 0.25, 1e-30])
    for value in [0.0, 1e-12, 0.3, 0.5, 0.999999, 1.0 - 2.0 ** -53]:
        uniform = torch.full((8, 1), value, dtype=torch.float64)
        tokens = inverse_cdf(probs, uniform)
        assert bool((probs.gather(1, tokens[:, None]) > 0).all()), value
    many = torch.rand(8, 1000, generator=gen, dtype=torch.float64)
    for k in range(1000):
        tokens = inverse_cdf(probs, many[:, k: k + 1])
        assert bool((probs.gather(1, tokens[:, None]) > 0).all())


def test_its_picks_follow_the_probabilities():
    vocab = 8 * CDF_BLOCK
    probs = torch.zeros(1, vocab)
    where = torch.tensor([3, CDF_BLOCK + 9, 5 * CDF_BLOCK, vocab - 1])
    probs[0, where] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    uniform = (torch.arange(10000, dtype=torch.float64)[:, None] + 0.5) / 10000  # evenly spread
    tokens = inverse_cdf(probs.expand(10000, -1), uniform)
    counts = torch.stack([(tokens == w).sum() for w in where])
    assert int(counts.sum()) == 10000
    assert torch.equal(counts, torch.tensor([1000, 2000, 3000, 4000]))


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.1), (20, 1.0, 0.05), (0, 0.8, 0.2), (30, 0.9, 0.02)])
def test_truncation_keeps_what_transformers_warpers_keep(top_k, top_p, min_p):
    """The sampler's top-k -> top-p -> min-p against transformers' own warpers, in generate's order."""
    from transformers import LogitsProcessorList, MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(64, 1000) * 3.0
    warpers = LogitsProcessorList(
        ([TopKLogitsWarper(top_k)] if top_k else []) + ([TopPLogitsWarper(top_p)] if top_p < 1.0 else [])
        + [MinPLogitsWarper(min_p)])
    theirs = torch.isinf(warpers(None, logits.clone()))
    ours = torch.isinf(truncate(torch.log_softmax(logits, -1), SamplingParams(1.0, top_p, top_k, min_p=min_p)))
    assert ours.any(dim=-1).all() and (~ours).sum(dim=-1).min() >= 1  # every row drops some, keeps some
    assert torch.equal(ours, theirs)
