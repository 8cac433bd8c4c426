r"""Benchmark: achieved FLOP/s of GRPO training and of decoding, against the machine's measured matmul peak.

The physical limit of a dense decoder on a CPU is its matrix-multiply throughput, so each phase is reported as
achieved FLOP/s and as a share of that peak, all measured in one run::

    python benchmarks/bench_flops.py --model checkpoints/smollm2-135m-instruct --data tests/data/train_example.jsonl \
        --threads 1 --dtype bfloat16
    ...
    flops (bfloat16): peak 1185.4 GFLOP/s (2048^3 bfloat16 matmul, 1 threads; float32 192.3, bfloat16 1185.4);
        training 213.8 GFLOP/s (0.18 of peak); engine decode 103.0 GFLOP/s (0.09); hf decode 51.5 GFLOP/s (0.04)

What is counted (:func:`model_flops`; the usual dense-transformer arithmetic, as in the PaLM/Chinchilla papers):
``2 x (weights of every linear layer, LM head included)`` per token and pass, plus attention's two products,
``4 x layers x heads x head_dim`` per (query, key) pair the causal mask lets through. A backward pass costs two
forwards. Embedding lookups, norms, activations, softmax and RoPE are not counted (they are memory-bound work the
profile below shows). Decoding counts only the generated tokens' passes, at their real context lengths.

Phases, each timed over ``--repeats`` runs (median):

* peak: a ``--peak-size`` cubed matmul (``2 n^3`` FLOPs) in float32 and in bfloat16 (on CPUs with AMX or
  AVX512-BF16, oneDNN runs bf16 products several times faster); each phase is set against the peak of its dtype;
* training: forward + backward of the chunked completion log-probs
(:func:`rlflow.training.logprobs.completion_logprobs`,
  what a GRPO update runs) on ``--seqs`` padded sequences of a data prompt plus ``--completion`` tokens;
* decoding: the ``engine`` and ``hf`` backends sampling ``--prompts`` x ``--n`` completions of up to
  ``--completion`` tokens (prefill included in the time, not in the FLOPs: a lower bound on decode efficiency).

``--dtype bfloat16`` measures the bf16 settings rlflow offers, against the bf16 peak: training under
``torch.autocast("cpu", bfloat16)`` with float32 master weights (what ``trainer.precision: bf16-mixed`` runs),
the engine decoding through bf16 copies of the weights (``data.rollout.init_args.dtype: bfloat16``), and
``generate`` on the model cast to bf16.

``--profile`` prints torch.profiler's top operators of one training pass and one engine rollout: where the time
that is not matrix products goes. Simplifications: CPU or one device, float32, no packing in the training phase
(packing changes which tokens are padded, not the FLOPs per real token). ``--device cuda`` runs every phase on the
GPU (timings synchronised), against the GPU's own matmul peaks; ``--profile`` then still lists CPU-side operator
time only.
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


def linear_weights(model: torch.nn.Module) -> int:
    """Weights of every ``nn.Linear`` (the LM head counted even when tied to the embeddings, since it multiplies)."""
    total = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head = model.get_output_embeddings()
    if head is not None and not isinstance(head, torch.nn.Linear):
        total += head.weight.numel()
    return total


def attention_width(model: torch.nn.Module) -> tuple[int, int]:
    """``(layers, heads x head_dim)`` of the query projection."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_attention_heads * head_dim


def model_flops(model: torch.nn.Module, tokens: int, attended_pairs: int, passes: int = 1) -> float:
    """Forward FLOPs for ``tokens`` positions attending to ``attended_pairs`` (query, key) pairs in all, times
    ``passes`` (3 for forward + backward)."""
    layers, width = attention_width(model)
    return passes * (2.0 * linear_weights(model) * tokens + 4.0 * layers * width * attended_pairs)


def causal_pairs(length: int) -> int:
    """(query, key) pairs of one causal sequence of ``length`` tokens."""
    return length * (length + 1) // 2


def synchronize() -> None:
    """Wait for the GPU's queued kernels (a no-op without CUDA), so a timing covers the work, not its launch."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_peak(size: int, repeats: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> float:
    a, b = (torch.randn(size, size, dtype=dtype, device=device) for _ in range(2))
    seconds = min(median_time(lambda: a @ b, 1) for _ in range(repeats))
    return 2.0 * size**3 / seconds


def training_batch(prompts: list[list[int]], completion: int, vocab: int, pad_id: int, seed: int):
    from rlflow.data.experience import Experience, collate

    gen = torch.Generator().manual_seed(seed)
    experiences = [
        Experience(prompt_ids=p, completion_ids=torch.randint(vocab, (completion,), generator=gen).tolist(),
                   rollout_logprobs=[0.0] * completion, reward=0.0, advantage=1.0, group=i, finish_reason="length",
                   policy_version=0)
        for i, p in enumerate(prompts)
    ]
    return collate(experiences, pad_id)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap, prompts=4)
    ap.add_argument("--seqs", type=int, default=8, help="sequences in the training pass")
    ap.add_argument("--completion", type=int, default=48, help="completion tokens (training) / most new tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peak-size", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: model, batches and the peak's matmul on the GPU")
    ap.add_argument("--profile", action="store_true", help="print the top operators of training and decoding")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="float32 throughout, or bf16: autocast training, bf16 engine copies, generate on a bf16 model")
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.plain_generate import PlainGenerateRollout
    from rlflow.rollout.base import SamplingParams
    from rlflow.rollout.engine import EngineRollout
    from rlflow.training.logprobs import completion_logprobs

    if args.threads:
        torch.set_num_threads(args.threads)
    if not Path(args.model).exists():
        raise FileNotFoundError(f"--model {args.model} does not exist (tools/get_smollm2.py, tools/make_tiny_model.py)")
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(args.device)
    tok = AutoTokenizer.from_pretrained(args.model)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    prompts = load_prompts(args.data, tok, max(args.seqs, args.prompts))
    threads = torch.get_num_threads()

    where = f"{threads} threads" if args.device == "cpu" else args.device
    peaks = {name: matmul_peak(args.peak_size, args.repeats, getattr(torch, name), args.device)
             for name in ("float32", "bfloat16")}
    for name, value in peaks.items():
        print(f"peak: {value / 1e9:.1f} GFLOP/s ({args.peak_size}^3 {name} matmul, {where})", flush=True)
    peak = peaks[args.dtype]
    bf16 = args.dtype == "bfloat16"
    autocast = torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16, enabled=bf16)

    # training: forward + backward of the completion log-probs, as a GRPO update runs them
    batch = training_batch(prompts[: args.seqs], args.completion, model.config.vocab_size, pad_id, args.seed)
    batch = {k: v.to(args.device) for k, v in batch.items()}
    model.train()

    def train_pass():
        model.zero_grad(set_to_none=True)
        with autocast:
            logprobs, _ = completion_logprobs(model, batch)
        (logprobs * batch["completion_mask"]).sum().backward()

    lengths = batch["attention_mask"].sum(1).tolist()
    train_flops = model_flops(model, sum(lengths), sum(causal_pairs(n) for n in lengths), passes=3)
    train_s = median_time(train_pass, args.repeats)
    train_rate = train_flops / train_s
    print(f"training ({'bf16 autocast' if bf16 else 'float32'}): {args.seqs} sequences, {sum(lengths)} tokens, "
          f"{train_s:.2f} s = {train_rate / 1e9:.1f} GFLOP/s ({train_rate / peak:.2f} of the {args.dtype} peak)",
          flush=True)

    # decoding: generated tokens only, at their real context lengths
    model.eval()
    params = SamplingParams(1.0, 1.0, 0, args.completion, [tok.eos_token_id] if tok.eos_token_id is not None else [])
    rollout_prompts = prompts[: args.prompts]
    decode: dict[str, float] = {}
    half = copy.deepcopy(model).to(torch.bfloat16) if bf16 else model
    engine_kwargs = {"dtype": "bfloat16"} if bf16 else {}
    backends = {"engine": EngineRollout(seed=args.seed, **engine_kwargs), "hf": PlainGenerateRollout()}
    for name, backend in backends.items():
        backend.bind(model if name == "engine" else half, tok)
        result: list = []

        def rollout(backend=backend, result=result):
            result[:] = backend.generate(rollout_prompts, params, n=args.n)

        seconds = median_time(rollout, args.repeats)
        tokens = pairs = 0
        for prompt, group in zip(rollout_prompts, result):
            for c in group:
                tokens += len(c.token_ids)
                pairs += sum(len(prompt) + t + 1 for t in range(len(c.token_ids)))
        decode[name] = model_flops(model, tokens, pairs) / seconds
        print(f"{name} decode: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s, "
              f"{decode[name] / 1e9:.1f} GFLOP/s ({decode[name] / peak:.2f} of peak)", flush=True)

    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        engine = EngineRollout(seed=args.seed, **engine_kwargs)
        engine.bind(model, tok)
        phases = (("training pass", train_pass, True),
                  ("engine rollout", lambda: engine.generate(rollout_prompts, params, n=args.n), False))
        for name, fn, training in phases:
            model.train(training)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                fn()
            print(f"--- profile of one {name}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))

    print(f"flops ({args.dtype}): peak {peak / 1e9:.1f} GFLOP/s ({args.peak_size}^3 {args.dtype} matmul, {where}; "
          f"float32 {peaks['float32'] / 1e9:.1f}, bfloat16 {peaks['bfloat16'] / 1e9:.1f}); training "
          f"{train_rate / 1e9:.1f} GFLOP/s ({train_rate / peak:.2f} of peak); engine decode "
          f"{decode['engine'] / 1e9:.1f} GFLOP/s ({decode['engine'] / peak:.2f}); hf decode "
          f"{decode['hf'] / 1e9:.1f} GFLOP/s ({decode['hf'] / peak:.2f})")
    return {"peak": peak, **{f"peak_{k}": v for k, v in peaks.items()}, "training": train_rate,
            **{f"{k}_decode": v for k, v in decode.items()}}


if __name__ == "__main__":
    main()
