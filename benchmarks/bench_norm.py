r"""Benchmark: the engine's 16-bit decode with its RMS norms by the model's formula (``norm: model``) against
``F.rms_norm`` (``norm: torch``, the default on a CUDA GPU): speed, and how far each one's sampled log-probs lie
from the model's own bf16 and float32 forwards on the same tokens.

Both engines decode the same prompts in bf16 (copies of the float32 weights), alternately, ``--repeats`` times
after one warm-up each; the ratio is the median of the paired times. The log-prob gaps are over the first two
completions of each prompt of the last run, teacher-forced through the model (float32, and cast to bf16)::

    python benchmarks/bench_norm.py --model /tmp/qwen3-0.6b-shape --device cuda --max-tokens 128 --repeats 3
    ... bf16 norm=torch: median 2394.8 ms, time/model paired 0.687; |engine - bf16 forward| mean 0.0074 ...

On a CPU the two take about as long (``auto`` keeps the model's formula there).
Simplifications: prompts are the first ``--prompts`` rows of a jsonl file; one device.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

if not __package__:  # run as ``python benchmarks/<name>.py``: the repository root, for ``benchmarks.`` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_rollout import add_model_args, load_prompts  # noqa: E402


@torch.no_grad()
def forward_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log_softmax of one plain forward over prompt + completion, at the completion's tokens (float64, on the CPU)."""
    ids = torch.tensor([prompt + tokens], device=next(model.parameters()).device)
    logits = model(ids).logits[0, len(prompt) - 1: -1].double()
    return torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt):, None])[:, 0].cpu()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="timed rollouts of each engine (alternating)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlflow.rollout.base import SamplingParams
    from rlflow.rollout.engine import EngineRollout

    model = AutoModelForCausalLM.from_pretrained(args.model).eval().to(args.device)
    half = copy.deepcopy(model).to(torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = load_prompts(args.data, tok, args.prompts)
    params = SamplingParams(1.0, 1.0, 0, args.max_tokens, [tok.eos_token_id])
    engines = {norm: EngineRollout(seed=0, dtype="bfloat16", norm=norm) for norm in ("model", "torch")}
    for engine in engines.values():
        engine.bind(model, tok)
        engine.generate(prompts, params, n=args.n)  # warm-up: kernel selection, the allocator's growth
    times: dict[str, list[float]] = {norm: [] for norm in engines}
    groups = {}
    for _ in range(args.repeats):
        for norm, engine in engines.items():
            start = time.perf_counter()
            groups[norm] = engine.generate(prompts, params, n=args.n)  # lists: the kernels have finished
            times[norm].append(time.perf_counter() - start)
    out = {}
    for norm in engines:
        to_half, to_float = [], []
        for prompt, group in zip(prompts, groups[norm]):
            for c in group[:2]:
                got = torch.tensor(c.logprobs, dtype=torch.float64)
                to_half.append((got - forward_logprobs(half, prompt, c.token_ids)).abs())
                to_float.append((got - forward_logprobs(model, prompt, c.token_ids)).abs())
        to_half, to_float = torch.cat(to_half), torch.cat(to_float)
        paired = statistics.median(t / m for t, m in zip(times[norm], times["model"]))
        out[norm] = {"ms": statistics.median(times[norm]) * 1e3, "paired": paired,
                     "gap_bf16_mean": float(to_half.mean()), "gap_fp32_mean": float(to_float.mean())}
        print(f"{args.model} bf16 norm={norm:5s}: median {out[norm]['ms']:.1f} ms, time/model paired {paired:.3f}; "
              f"|engine - bf16 forward| mean {to_half.mean():.4f} max {to_half.max():.3f}; "
              f"|engine - fp32 forward| mean {to_float.mean():.4f} max {to_float.max():.3f} ({to_half.numel()} "
              f"tokens; {args.device})", flush=True)
    return out


if __name__ == "__main__":
    main()
