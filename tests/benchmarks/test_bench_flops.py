"""benchmarks/bench_flops.py's FLOP count, checked against torch's own FlopCounterMode (an independent count of every
matrix product a forward runs) and against a count by hand of a tiny model's weights."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import bench_flops
from tests.helpers.tiny_archs import tiny_causal_lm


def test_linear_weights_by_hand():
    model = tiny_causal_lm("llama")  # hidden 32, 4 heads x 8, 2 kv heads, mlp 64, 2 layers, vocab 128, untied head
    per_layer = 32 * 32 + 2 * (32 * 16) + 32 * 32 + 3 * (32 * 64)  # q, k and v, o, gate/up/down
    assert bench_flops.linear_weights(model) == 2 * per_layer + 128 * 32
    assert bench_flops.attention_width(model) == (2, 32)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_forward_flops_equal_torchs_flop_counter(name):
    model = tiny_causal_lm(name, attn_implementation="eager")  # attention as two matmuls the counter sees
    length = 24
    ids = torch.randint(128, (1, length))
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=ids)
    # eager attention multiplies the full square of (query, key) pairs, the causal mask applied afterwards
    assert bench_flops.model_flops(model, length, length * length) == counter.get_total_flops()


def test_backward_counts_two_forwards():
    model = tiny_causal_lm("llama")
    forward = bench_flops.model_flops(model, 10, bench_flops.causal_pairs(10))
    assert bench_flops.model_flops(model, 10, bench_flops.causal_pairs(10), passes=3) == 3 * forward
    assert bench_flops.causal_pairs(4) == 4 + 3 + 2 + 1
