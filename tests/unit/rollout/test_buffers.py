"""The sampler's reused buffers (:mod:`rlflow.rollout.buffers`).

What is checked: :func:`~rlflow.rollout.sampling.sample_tokens` with buffers returns exactly the tokens and
log-probs it returns without them (float32 and bfloat16 logits; temperature, top-k, top-p, greedy), step after
step on one set of buffers while the row count shrinks and grows; a buffer is one block of memory reused, not
allocated anew per call.
"""

from __future__ import annotations

import pytest
import torch

from rlflow.rollout.base import SamplingParams
from rlflow.rollout.buffers import VocabBuffers
from rlflow.rollout.sampling import sample_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("params", [
    SamplingParams(1.0, max_tokens=4), SamplingParams(0.7, top_p=0.9, max_tokens=4),
    SamplingParams(1.3, top_k=5, max_tokens=4), SamplingParams(0.0, max_tokens=4)])
def test_sampling_with_buffers_gives_exactly_the_same_tokens_and_logprobs(dtype, params):
    gen = torch.Generator().manual_seed(3)
    buffers = VocabBuffers()
    for rows in (12, 12, 7, 3, 16):  # rows leave the batch, then a bigger batch reuses (and grows) the buffers
        logits = (torch.randn(rows, 301, generator=gen) * 4).to(dtype)
        uniform = torch.rand(rows, generator=gen, dtype=torch.float64)
        want = sample_tokens(logits, params, uniform=uniform)
        got = sample_tokens(logits, params, uniform=uniform, buffers=buffers)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_buffer_is_one_block_viewed_to_each_size():
    buffers = VocabBuffers()
    big = buffers.get("cdf", torch.empty(8, 10), torch.float64)
    small = buffers.get("cdf", torch.empty(3, 10), torch.float64)
    assert big.shape == (8, 10) and small.shape == (3, 10) and big.dtype == torch.float64
    assert small.data_ptr() == big.data_ptr()
    assert buffers.get("probs", torch.empty(3, 10)).data_ptr() != big.data_ptr()  # one block per name
    grown = buffers.get("cdf", torch.empty(9, 10), torch.float64)
    assert grown.shape == (9, 10)
