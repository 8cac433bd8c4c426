"""benchmarks/bench_attention.py: one small shape end to end; its figures are consistent with each other."""

from __future__ import annotations

import pytest

from benchmarks import bench_attention as bench


def test_one_shape_prints_times_their_ratio_and_the_gap(capsys):
    (result,) = bench.main(["--shapes", "2x5x9", "--heads", "4", "2", "--dim", "8", "--repeats", "2"])
    assert result["ratio"] == pytest.approx(result["bf16_ms"] / result["float32_ms"])
    assert 0 <= result["gap"] < 2 ** -6  # two roundings of one attention to bf16
    out = capsys.readouterr().out
    assert "2x5x9" in out and f"{result['ratio']:.2f}x" in out


def test_the_mask_is_causal_behind_the_prompt():
    *_, mask = bench.states(1, 2, 5, 2, 1, 4)
    assert mask[0, 0].tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
