"""benchmarks/bench_norm.py on a CPU: both engines decode, and each one's log-probs lie within bf16 rounding of the
model's bf16 forward on the tokens it sampled (a norm that was skipped or computed wrongly would
put them far off); the speed ratio is the benchmark's business, not this test's."""

from __future__ import annotations

from benchmarks import bench_norm


def test_both_norms_decode_within_bf16_rounding(tiny_model, tiny_data, capsys):
    out = bench_norm.main(["--model", str(tiny_model), "--data", str(tiny_data / "train.jsonl"), "--prompts", "3",
                           "--n", "2", "--max-tokens", "6", "--repeats", "1", "--device", "cpu"])
    assert set(out) == {"model", "torch"}
    for norm, figures in out.items():
        assert 0 <= figures["gap_bf16_mean"] < 0.02, (norm, figures)
        assert figures["gap_fp32_mean"] < 0.05, (norm, figures)
        assert figures["ms"] > 0 and figures["paired"] > 0
    assert "norm=torch" in capsys.readouterr().out
