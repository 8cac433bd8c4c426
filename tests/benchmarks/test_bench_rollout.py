"""benchmarks/bench_rollout.py on a CPU: --engine-settings reaches every engine it times, --profile profiles one
more rollout of the backend it names, the ratio lines are of the runs it printed, --only times the backends it names,
--fresh-prompts gives every run other prompts, --with-torch-ops times the engine without its compiled operations,
and --no-cudnn-attention turns cuDNN's attention kernel off first."""

from __future__ import annotations

import pytest

from benchmarks import bench_rollout
from rlflow.rollout import engine as engine_module


def test_engine_settings_and_profile(tiny_model, tiny_data, capsys, monkeypatch):
    built = []
    real = engine_module.EngineRollout

    class Recording(real):
        def __init__(self, **kwargs):
            built.append(kwargs)
            super().__init__(**kwargs)

    monkeypatch.setattr(engine_module, "EngineRollout", Recording)
    out = bench_rollout.main(["--model", str(tiny_model), "--data", str(tiny_data / "train.jsonl"), "--prompts", "2",
                              "--n", "2", "--max-tokens", "4", "--repeats", "2", "--rollouts", "1",
                              "--engine-settings", '{"max_batch_size": 3}', "--profile", "engine"])
    assert built and all(kw["max_batch_size"] == 3 and kw["seed"] == 0 for kw in built)
    printed = capsys.readouterr().out
    assert "under the profiler), top operators by self_cpu_time_total" in printed
    runs: dict[str, list[float]] = {}
    for line in printed.splitlines():
        if line.startswith("run "):
            runs.setdefault(line.split()[2].rstrip(":"), []).append(float(line.split("= ")[1].split(" tok/s")[0]))
    assert set(runs) == {"hf", "engine"} and all(len(v) == 2 for v in runs.values())
    for name, rates in runs.items():  # the medians of the printed runs (printed to one decimal)
        assert out[f"{name}_tok_s"] == pytest.approx(sum(rates) / 2, abs=0.1)
    assert out["ratio"] == pytest.approx(out["engine_tok_s"] / out["hf_tok_s"])


def test_an_unknown_profile_name_is_refused_before_anything_runs(tiny_model, tiny_data):
    with pytest.raises(SystemExit):
        bench_rollout.main(["--model", str(tiny_model), "--data", str(tiny_data / "train.jsonl"), "--profile", "nope"])


def test_only_and_fresh_prompts(tiny_model, tiny_data, capsys, monkeypatch):
    calls = []
    real = engine_module.EngineRollout.generate

    def recording(self, prompts, params, n=1, progress=None):
        calls.append([tuple(p) for p in prompts])
        return real(self, prompts, params, n, progress)

    monkeypatch.setattr(engine_module.EngineRollout, "generate", recording)
    out = bench_rollout.main(["--model", str(tiny_model), "--data", str(tiny_data / "train.jsonl"), "--prompts", "3",
                              "--n", "2", "--max-tokens", "4", "--repeats", "3", "--rollouts", "1", "--only", "engine",
                              "--fresh-prompts", "--full-warmup"])
    printed = capsys.readouterr().out
    assert set(out) == {"engine_tok_s"} and "hf" not in printed and "speedup" not in printed
    calls = calls[-4:]  # the warm-up, then the three timed runs (bind's probe decode before them)
    assert all(len(c) == 3 for c in calls)
    assert len({p for c in calls for p in c}) == 12  # four distinct blocks of three prompts
    with pytest.raises(SystemExit):
        bench_rollout.main(["--model", str(tiny_model), "--data", str(tiny_data / "train.jsonl"), "--only", "nope"])


def test_with_torch_ops_times_the_engine_without_its_compiled_operations(tiny_model, tiny_data, monkeypatch):
    from rlflow.rollout import decode_ops, prepack
    from rlflow.rollout.fused import FusedDecoder

    if not decode_ops.available():
        pytest.skip("rlflow's compiled decode operations do not run here (no AVX-512, or their build failed)")
    monkeypatch.setattr(prepack, "MIN_NUMEL", 1)  # the tiny model's matrices pack as a real model's do
    monkeypatch.setattr(prepack, "float32_kernel", lambda: "row_gemm")
    seen = set()
    real = FusedDecoder.step

    def recording(self, *args, **kwargs):
        seen.add(self.compiled_ops)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FusedDecoder, "step", recording)
    out = bench_rollout.main(["--model", str(tiny_model), "--data", str(tiny_data / "train.jsonl"), "--prompts", "2",
                              "--n", "2", "--max-tokens", "4", "--repeats", "1", "--rollouts", "1",
                              "--with-torch-ops", "--only", "engine,engine-torch-ops"])
    assert seen == {True, False}  # the engine's decoder uses them, the variant's does not
    assert out["ratio-over-torch-ops"] == pytest.approx(out["engine_tok_s"] / out["engine-torch-ops_tok_s"])


def test_no_cudnn_attention_turns_cudnns_kernel_off_before_any_backend_runs(tiny_model, tiny_data, monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: calls.append(("cudnn", on)))
    real = engine_module.EngineRollout.generate

    def recording(self, prompts, params, n=1, progress=None):
        calls.append("engine")
        return real(self, prompts, params, n, progress)

    monkeypatch.setattr(engine_module.EngineRollout, "generate", recording)
    args = ["--model", str(tiny_model), "--data", str(tiny_data / "train.jsonl"), "--prompts", "2", "--n", "2",
            "--max-tokens", "4", "--repeats", "1", "--rollouts", "1", "--only", "engine"]
    bench_rollout.main(args)
    assert calls and ("cudnn", False) not in calls  # left alone without the flag
    calls.clear()
    bench_rollout.main([*args, "--no-cudnn-attention"])
    assert calls[0] == ("cudnn", False) and "engine" in calls[1:]
