"""The benchmarks' continuous-batching anchor (:class:`benchmarks.continuous_batching.ContinuousBatchingRollout`,
transformers' ``generate_batch``), ``bench_rollout.py --continuous-batching``, ``--without-graphs``,
``--bf16-policy`` and ``--with-mkl``."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.continuous_batching import ContinuousBatchingRollout
from rlflow.rollout import prepack
from rlflow.rollout.base import SamplingParams

pytestmark = pytest.mark.slow
#: a KV cache and input buffers sized for these tests' few short rows (the default sizes them from the host's memory)
SMALL = {"num_blocks": 16, "page_size": 16, "max_batch_tokens": 64}


def test_greedy_groups_are_model_generates_tokens_in_prompt_order(tiny_model, tokenizer, one_thread):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    prompts = [tokenizer(text)["input_ids"] for text in ("1+2=", "30+4=", "7*8=")]
    eos = tokenizer.eos_token_id
    params = SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[eos])
    anchor = ContinuousBatchingRollout(**SMALL)
    anchor.bind(model, tokenizer)
    groups = anchor.generate(prompts, params, n=2)
    assert len(groups) == 3 and all(len(g) == 2 for g in groups)
    for prompt, group in zip(prompts, groups):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos)[0, len(prompt):].tolist()
        want = want[: want.index(eos) + 1] if eos in want else want
        assert [c.token_ids for c in group] == [want, want]
        assert {c.finish_reason for c in group} == {"stop" if want[-1] == eos else "length"}


def test_bench_rollout_prints_the_engine_over_continuous_batching(tiny_model, capsys):
    from benchmarks.bench_rollout import main

    out = main(["--model", str(tiny_model), "--data", str(tiny_model.parent / "data" / "train.jsonl"),
                "--prompts", "2", "--n", "2", "--max-tokens", "6", "--repeats", "1", "--rollouts", "1",
                "--threads", "1", "--continuous-batching", "--cb-settings", json.dumps(SMALL)])
    printed = capsys.readouterr().out
    assert out["cb_tok_s"] > 0 and out["ratio-over-continuous-batching"] == pytest.approx(
        out["engine_tok_s"] / out["cb_tok_s"])
    assert "rollout engine/cb speedup:" in printed and "run 1 cb" in printed


def test_bench_rollout_prints_the_engine_over_its_eager_steps(tiny_model, capsys, monkeypatch):
    from benchmarks.bench_rollout import main
    from rlflow.rollout import engine

    monkeypatch.setattr(engine, "capture_kind", lambda device: "eager")  # graphs as on a GPU, run eagerly here

    out = main(["--model", str(tiny_model), "--data", str(tiny_model.parent / "data" / "train.jsonl"),
                "--prompts", "2", "--n", "2", "--max-tokens", "6", "--repeats", "1", "--rollouts", "1",
                "--threads", "1", "--dtype", "both", "--without-graphs"])
    printed = capsys.readouterr().out
    for label, fast in (("", "engine"), ("-bf16", "engine-bf16")):
        assert out[f"ratio{label}-over-eager"] == pytest.approx(out[f"{fast}_tok_s"] / out[f"{fast}-eager_tok_s"])
        assert f"rollout {fast}/{fast}-eager speedup:" in printed
        assert f"\n{fast}: decode steps as CUDA graphs, " in printed and f"\n{fast}-eager: decode" not in printed


def test_bench_rollout_prints_the_engine_over_its_unsplit_groups(tiny_model, capsys):
    from benchmarks.bench_rollout import main

    out = main(["--model", str(tiny_model), "--data", str(tiny_model.parent / "data" / "train.jsonl"),
                "--prompts", "2", "--n", "4", "--max-tokens", "6", "--repeats", "1", "--rollouts", "1",
                "--threads", "1", "--without-split", "--without-graphs"])
    printed = capsys.readouterr().out
    assert out["ratio-over-whole"] == pytest.approx(out["engine_tok_s"] / out["engine-whole_tok_s"])
    assert "rollout engine/engine-whole speedup:" in printed and "rollout engine/engine-eager speedup:" in printed


def test_bench_rollout_times_a_bf16_policy_against_generate_on_it(tiny_model, capsys, monkeypatch):
    from benchmarks.bench_rollout import main
    from rlflow.rollout import engine

    monkeypatch.setattr(engine, "bf16_faster", lambda device: False)  # a CPU where bf16 is not faster: auto is float32
    decoders = []
    real = engine.FusedDecoder.__init__

    def init(self, model, *args, **kwargs):
        real(self, model, *args, **kwargs)
        decoders.append((next(model.parameters()).dtype, self.dtype))

    monkeypatch.setattr(engine.FusedDecoder, "__init__", init)
    out = main(["--model", str(tiny_model), "--data", str(tiny_model.parent / "data" / "train.jsonl"),
                "--prompts", "2", "--n", "2", "--max-tokens", "6", "--repeats", "1", "--rollouts", "1",
                "--threads", "1", "--bf16-policy"])
    printed = capsys.readouterr().out
    for fast in ("engine-bf16-policy", "engine-bf16-policy-auto"):
        assert out[f"ratio-{fast[7:]}"] == pytest.approx(out[f"{fast}_tok_s"] / out["hf-bf16_tok_s"])
        assert f"rollout {fast}/hf-bf16 speedup:" in printed
    # the bf16 policy decoded in bf16 (dtype model) and through float32 copies (auto); the float32 model as it is
    assert {(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float32, torch.float32)} == \
        set(decoders)


def test_the_anchor_takes_trls_memory_share_unless_told_otherwise():
    assert ContinuousBatchingRollout().settings.max_memory_percent == 0.5
    own = ContinuousBatchingRollout(max_memory_percent=0.2, num_blocks=8).settings
    assert own.max_memory_percent == 0.2 and own.num_blocks == 8


@pytest.mark.skipif(not (prepack._mkl() and prepack._onednn()), reason="torch built without MKL or oneDNN")
def test_bench_rollout_with_mkl_packs_its_variant_through_mkl(tiny_model, capsys, monkeypatch):
    from benchmarks.bench_rollout import main

    monkeypatch.setattr(prepack, "MIN_NUMEL", 1)  # the tiny model's matrices pack too
    monkeypatch.setattr(prepack, "float32_kernel", lambda: "onednn")  # an AVX2 CPU's choice, on any CPU
    kernels = []
    real = prepack.PackedWeight.__init__

    def init(self, *args, **kwargs):
        real(self, *args, **kwargs)
        kernels.append("mkl" if self.mkl else "onednn")

    monkeypatch.setattr(prepack.PackedWeight, "__init__", init)
    out = main(["--model", str(tiny_model), "--data", str(tiny_model.parent / "data" / "train.jsonl"),
                "--prompts", "2", "--n", "2", "--max-tokens", "6", "--repeats", "1", "--rollouts", "1",
                "--threads", "1", "--with-mkl"])
    printed = capsys.readouterr().out
    assert out["ratio-over-mkl"] == pytest.approx(out["engine_tok_s"] / out["engine-mkl_tok_s"])
    assert "rollout engine/engine-mkl speedup:" in printed and "run 1 engine-mkl" in printed
    assert {"mkl", "onednn"} <= set(kernels)
