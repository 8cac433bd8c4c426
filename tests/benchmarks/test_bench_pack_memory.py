"""benchmarks/bench_pack_memory.py: the packs it builds have the stated sizes and layouts, and one measurement runs
on the tiny model."""

from __future__ import annotations

import argparse
import json
import random

import pytest

from benchmarks import bench_pack_memory as bench
from rlflow.training.packing import collate_packed


@pytest.mark.parametrize("tokens", [300, 2048, 5000])
def test_mixed_lengths_fill_the_pack_exactly_with_sequences_of_the_stated_sizes(tokens):
    lengths = bench.mixed_lengths(random.Random(tokens), tokens)
    assert sum(p + c for p, c in lengths) == tokens
    assert all(p >= 1 and c >= 1 for p, c in lengths)
    assert all(p + c <= 2048 for p, c in lengths)
    assert all(p + c >= 256 for p, c in lengths[:-1])  # only the last one is cut to fit


@pytest.mark.parametrize("layout", ["mix", "seq-len", "share"])
def test_each_layout_packs_into_one_row_of_the_asked_tokens(layout):
    exps = bench.experiences({"layout": layout, "tokens": 3000}, vocab=500)
    batch = collate_packed(exps, share_prompts=layout == "share")
    assert batch["input_ids"].shape == (1, 3000)  # shared prompts laid once: still the asked size
    if layout == "seq-len":
        assert len(exps) == 1
    if layout == "share":
        groups = {e.group for e in exps}
        assert all(sum(e.group == g for e in exps) <= 4 for g in groups) and len(exps) > len(groups)


def test_one_measurement_on_the_tiny_model_reports_its_tokens_peak_and_time(tiny_model):
    args = argparse.Namespace(model=tiny_model, threads=1, precision="32", steps=1,
                              child=json.dumps({"layout": "mix", "variant": "packed", "tokens": 1024}))
    result = bench.child(args)
    assert result["tokens"] == 1024 and result["sequences"] >= 1
    assert result["peak_bytes"] > 0 and result["seconds"] > 0 and result["bf16"] is False
