"""On a CUDA GPU: the engine's decode (float32 and bf16), packed log-probs, and ``rlflow fit`` steps under FSDP2.

Every test here is marked ``gpu`` and skipped where CUDA is absent (CI's machines have none).
``tools/gpu_check.sh`` runs them with the GPU benchmarks in one go on a lent machine. Each is the GPU counterpart of
a CPU test:

* the fused engine's log-probs on CUDA equal one full forward of the model on CUDA (``test_engine.py``);
* decode steps replayed as piecewise CUDA graphs give the eager steps' logits, and the engine's tokens with graphs
  equal its tokens without (``test_graphs.py``, which runs the segments eagerly);
* a bf16 rollout's attention never takes cuDNN's kernel (``test_hardware.py``);
* ``dtype: auto`` decodes in bf16 on a GPU, within bf16 rounding of the model's own bf16 forward, with the RMS
  norms through ``F.rms_norm`` (``norm: auto``) and through the model's formula. The bound is measured in the
  test, as in ``test_engine_dtype.py``;
* rlflow's var-len attention gives packed log-probs equal to padded ones on CUDA, in float32 and bf16
  (``test_packing_support.py``);
* a few ``rlflow fit`` steps run under ``fsdp2_bf16`` (one rank) and under ``bf16-mixed``, with the KL term's
  reference model and a dense reward. Each step has a finite loss and gradient norm and moves the weights
  (``optim/update_fraction``). Both run in a subprocess: Lightning opens a process group for FSDP2.

Simplifications: one GPU. Multi-GPU FSDP runs are covered on CPU (gloo, ``test_distributed.py``). Speed is
measured by ``benchmarks/bench_rollout.py --device cuda``, not here.
"""

from __future__ import annotations

import copy
import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlflow.rollout import fused
from rlflow.rollout.base import SamplingParams
from rlflow.rollout.engine import EngineRollout
from tests.helpers.fit import fit_args
from tests.helpers.paths import ROOT
from tests.helpers.tiny_archs import IdTokenizer, tiny_causal_lm
from tests.unit.rollout.test_engine import prompts_of
from tests.unit.rollout.test_fused_decoder import build
from tests.unit.rollout.test_graphs import check_graphed_steps

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@torch.no_grad()
def forward_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of one plain forward over prompt + completion, at the completion's tokens (CPU)."""
    device = next(model.parameters()).device
    logits = model(torch.tensor([prompt + tokens], device=device)).logits[0, len(prompt) - 1: -1].double()
    picked = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(tokens, device=device)[:, None])
    return picked[:, 0].cpu()


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_fused_engine_on_cuda_matches_a_full_forward(name):
    model = tiny_causal_lm(name, seed=1).cuda()
    engine = EngineRollout(seed=0)
    engine.bind(model, IdTokenizer())
    assert engine.decode_path == "fused decode, decode steps as CUDA graphs"
    prompts = prompts_of([11, 17, 8], seed=2)
    groups = engine.generate(prompts, SamplingParams(0.8, max_tokens=12), n=3)
    assert engine._kept_decoder[1].dtype == torch.float32
    for prompt, group in zip(prompts, groups):
        for c in group:
            got = torch.tensor(c.logprobs, dtype=torch.float64)
            torch.testing.assert_close(got, forward_logprobs(model, prompt, c.token_ids, 0.8), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind,dtype", [("qwen3", None), ("qwen3", torch.bfloat16), ("llama", torch.bfloat16)])
def test_cuda_graphed_decode_steps_give_the_eager_steps_logits(kind, dtype):
    """Real CUDA graph captures of the piecewise segments (``test_graphs.py`` runs the same check eagerly)."""
    model = build(kind).cuda()
    check_graphed_steps(fused.FusedDecoder(model, dtype), "cuda", atol=1e-4 if dtype is None else 0.05,
                        device="cuda")


def test_the_engine_decodes_through_cuda_graphs_to_the_eager_engines_tokens():
    """In float32 (bf16 steps are compared above: a bf16 tie may fall either way between two GEMM kernels)."""
    model = tiny_causal_lm("qwen3", seed=1).cuda()
    prompts = prompts_of([11, 17, 8, 5], seed=2)
    params = SamplingParams(0.0, max_tokens=16, stop_token_ids=[7])  # greedy: the same tokens up to rounding ties
    runs = {}
    for graphs in (False, True):
        engine = EngineRollout(seed=0, cuda_graphs=graphs, max_batch_size=16)
        engine.bind(model, IdTokenizer())
        runs[graphs] = engine.generate(prompts, params, n=3)
        assert (engine._graphed is not None) == graphs and engine.graphs_error is None
    assert [[c.token_ids for c in g] for g in runs[True]] == [[c.token_ids for c in g] for g in runs[False]]
    for got, want in zip(runs[True], runs[False]):
        for g, w in zip(got, want):
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=0)


def test_a_bf16_rollout_runs_no_cudnn_attention_kernel():
    """cuDNN's attention builds a plan per new shape; the engine's decode and prefill attention take other kernels."""
    from torch.profiler import ProfilerActivity, profile

    model = tiny_causal_lm("qwen3", seed=1).cuda()
    engine = EngineRollout(seed=0, dtype="bfloat16")
    engine.bind(model, IdTokenizer())
    torch.backends.cuda.enable_cudnn_sdp(True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts_of([11, 17, 8], seed=2), SamplingParams(1.0, max_tokens=8), n=3)
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    assert any("scaled_dot_product" in n for n in names)  # attention did run through SDPA
    assert not [n for n in names if "cudnn" in n.lower() and ("attention" in n.lower() or "sdpa" in n.lower())]
    assert torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.parametrize("norm", ["auto", "model"])
def test_auto_dtype_decodes_in_bf16_on_cuda_within_bf16_rounding(norm):
    """The bound is the model's own bf16 forward against its float32 forward on the same tokens; the engine's
    bf16 log-probs lie as close to the bf16 forward (a factor 2: another order of operations), with the RMS norms
    through ``F.rms_norm`` (``norm: auto`` on a GPU in bf16) and through the model's formula."""
    model = tiny_causal_lm("qwen3", seed=1).cuda()
    half = copy.deepcopy(model).to(torch.bfloat16)
    engine = EngineRollout(seed=0, dtype="auto", norm=norm)
    engine.bind(model, IdTokenizer())
    prompts = prompts_of([11, 17, 8], seed=2)
    groups = engine.generate(prompts, SamplingParams(1.0, max_tokens=12), n=3)
    assert engine._kept_decoder[1].dtype == torch.bfloat16
    assert engine._kept_decoder[1].rms_norm is (fused._torch_rms_norm if norm == "auto" else fused._rms_norm)
    engine_vs_half, float_vs_half = [], []
    for prompt, group in zip(prompts, groups):
        for c in group:
            got = torch.tensor(c.logprobs, dtype=torch.float64)
            bf16 = forward_logprobs(half, prompt, c.token_ids)
            engine_vs_half.append((got - bf16).abs())
            float_vs_half.append((forward_logprobs(model, prompt, c.token_ids) - bf16).abs())
    engine_vs_half, float_vs_half = torch.cat(engine_vs_half), torch.cat(float_vs_half)
    assert float_vs_half.max() > 0
    assert engine_vs_half.max() <= 2 * float_vs_half.max() + 1e-6
    assert engine_vs_half.mean() <= 2 * float_vs_half.mean() + 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_logprobs_equal_padded_ones_on_cuda(dtype):
    from rlflow.training.packing_support import probe_error

    model = tiny_causal_lm("qwen3", seed=3).to(device="cuda", dtype=dtype)
    assert probe_error(model) is None


def digit_share(completions, **kwargs):
    """A dense reward (share of digits in the completion): groups get different rewards from the first step."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


def even_id_share(completion_ids, **kwargs):
    """A dense reward on token ids (share of even ids): for random-init models whose samples mostly fall outside
    their tokenizer's vocabulary, so text rewards are all 0 (``tools/gpu_check.sh``)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def read_metrics(log_dir: Path) -> list[dict[str, float]]:
    with open(log_dir / "metrics.csv") as f:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    return [r for r in rows if "loss" in r]


@pytest.mark.parametrize("setting", [
    ("--trainer.strategy=fsdp2_bf16", "--trainer.precision=32-true"),
    ("--trainer.precision=bf16-mixed",),
], ids=["fsdp2_bf16", "bf16-mixed"])
def test_fit_steps_on_cuda(tiny_model, tiny_data, tmp_path, setting):
    args = fit_args(
        tiny_model,
        tiny_data,
        tmp_path,
        "--trainer.accelerator=gpu",
        *setting,
        "--model.optim.lr=1e-4",
        "--model.loss.kl_coef=0.01",
        '--data.judging.judgers={"*": "tests.integration.test_gpu:digit_share"}',
        "--model.export_hf=false",
        "--data.seed=0",
        steps=3,
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(
        [sys.executable, "-m", "rlflow", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = read_metrics(next(tmp_path.glob("lightning_logs/version_*")))
    assert len(rows) == 3
    for row in rows:
        assert math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0
        assert row["optim/update_fraction"] > 0  # the weights moved
        assert row["completions/mean_length"] > 0 and row["step_time"] > 0
