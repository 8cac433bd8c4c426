r"""Benchmark: completion tokens/s of the ``engine`` rollout backend against plain ``model.generate``
(transformers' own sampler: :class:`~benchmarks.plain_generate.PlainGenerateRollout`, not the ``hf`` backend's
per-row draws).

Both backends sample the same prompts with the same settings from the same model, alternately (hf, engine, hf,
engine, ...) so that load from other processes hits both alike; the medians over ``--repeats`` runs are
reported, and the last line (one line, wrapped here) is the ratio::

    python benchmarks/bench_rollout.py --model checkpoints/tiny-qwen3 --data checkpoints/arith/train.jsonl \
        --threads 2 --repeats 9
    ...
    rollout engine/hf speedup: 4.30x (engine 54656.3 tok/s, hf 12717.7 tok/s, median of 9 runs x 3 rollouts;
        median of paired run ratios 4.25x; 2 threads)

``--dtype bfloat16`` compares at the same precision on both sides: the engine decoding through bf16 copies of the
float32 weights (``EngineRollout(dtype="bfloat16")``, as in training) against ``generate`` on the model cast to
bf16; ``--dtype both`` runs the float32 pair and the bf16 pair in one run (four backends, alternating) and prints
a ratio line for each, plus bf16 engine over float32 ``generate``. ``--bf16-policy`` adds a policy loaded in bf16
(``model.policy.dtype: bfloat16``): the engine in the model's dtype (``dtype: model``) and with ``dtype: auto``
(bf16 where the device multiplies it natively, float32 copies on other CPUs), each against ``generate`` on that
model (``hf-bf16``).

``--continuous-batching`` adds transformers' ``generate_batch`` (paged KV cache, continuous batching: the path TRL
offers beside ``generate``; :mod:`benchmarks.continuous_batching`) as a second anchor at each precision, with a
ratio line of the engine over it.

``--without-graphs`` adds the engine with ``cuda_graphs=False`` at each precision (on a GPU: its decode steps
eager instead of replayed as CUDA graphs, :mod:`rlflow.rollout.graphs`; on a CPU both run eagerly), with a ratio
line of the engine over it; ``--without-split`` likewise the engine with ``split_stragglers=False`` (a group's
last rows never continue alone: :meth:`rlflow.rollout.serving.ServeCall.split_stragglers`), ``--with-rows`` the
engine with ``attention="rows"`` (a KV cache per row instead of per group). Every engine is seeded
with ``--seed``, so an engine and its variants draw the same random streams call after call: in float32 they
sample the same tokens (up to rounding), and their ratio is one of times. ``--with-mkl`` adds the float32 engine
with its matrices packed through MKL (:mod:`rlflow.rollout.prepack`; the engine itself packs through oneDNN on AVX2
CPUs and through rlflow's row GEMM on AVX-512 CPUs), with a ratio line of the engine over it; ``--with-torch-ops``
the float32 engine with the operations around its products as torch operators instead of rlflow's compiled ones
(:mod:`rlflow.rollout.decode_ops`, used where the row GEMM packs the decoder), likewise.

``--fresh-prompts`` gives every timed run other prompts (as every rollout of a training run has), so that what a
kernel library caches per shape is paid where training pays it; without it every run decodes the same prompts.

``--device cuda`` runs both on the GPU (their outputs are Python lists, so each timed rollout has finished its
kernels); add ``--full-warmup`` there. Simplifications: CPU or a single device; prompts are the first ``--prompts``
rows of an XTuner/TRL jsonl file rendered with the tokenizer's chat template (or given as plain strings); the warm-up
is one discarded short run (``--full-warmup``: one full-size rollout of each backend); each timed run is
``--rollouts`` rollouts back to back (one rollout of the engine is only ~60 ms on 2 cores, short enough for
scheduler noise to move a single timing by several per cent).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

if not __package__:  # run as ``python benchmarks/<name>.py``: the repository root, for ``benchmarks.`` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


#: ``(flag, name suffix, engine options)``: the engine variants a flag adds beside each engine, with a ratio line
VARIANTS = [("without_graphs", "eager", {"cuda_graphs": False}),
            ("without_split", "whole", {"split_stragglers": False}),
            ("with_rows", "rows", {"attention": "rows"})]


def load_prompts(path: str, tokenizer, count: int, at_most: bool = False) -> list[list[int]]:
    """Token ids of the first ``count`` prompts of a jsonl file (chat messages rendered with the chat template);
    ``at_most``: fewer where the file has fewer."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if len(prompts) == count:
                break
            row = json.loads(line)
            if "prompt" not in row:
                raise KeyError(f"{path}:{line_no}: no 'prompt' field")
            prompt = row["prompt"]
            text = prompt if isinstance(prompt, str) else tokenizer.apply_chat_template(
                prompt, add_generation_prompt=True, tokenize=False)
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(prompts) < count and not at_most:
        raise ValueError(f"{path} has only {len(prompts)} prompts, --prompts asks for {count}")
    return prompts


def add_model_args(ap: argparse.ArgumentParser, prompts: int = 16) -> None:
    """The model, the prompts' jsonl file, how many of its prompts, and completions per prompt: what every
    rollout benchmark here takes (``bench_rollout``, ``bench_flops``, ``bench_norm``)."""
    ap.add_argument("--model", default="checkpoints/tiny-qwen3", help="Hugging Face model directory")
    ap.add_argument("--data", default="checkpoints/arith/train.jsonl", help="jsonl with a 'prompt' field")
    ap.add_argument("--prompts", type=int, default=prompts, help="prompts per rollout")
    ap.add_argument("--n", type=int, default=8, help="completions per prompt (the GRPO group size)")


def run_once(backend, prompts, params, n, rollouts: int = 1) -> tuple[float, int, list[int]]:
    """``rollouts`` back-to-back rollouts of ``prompts`` x ``n``: seconds, completion tokens, their lengths."""
    lengths: list[int] = []
    start = time.perf_counter()
    for _ in range(rollouts):
        groups = backend.generate(prompts, params, n=n)
        lengths += [len(c.token_ids) for g in groups for c in g]
    return time.perf_counter() - start, sum(lengths), lengths


def profile_rollout(backend, prompts, params, n: int, cuda: bool, rows: int = 15) -> None:
    """One rollout under torch.profiler; prints its top operators by self device time (CPU time on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        backend.generate(prompts, params, n=n)
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    averages = prof.key_averages()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    print(f"--- profile of one rollout ({wall:.2f} s under the profiler), top operators by {key}")
    print(averages.table(sort_by=key, row_limit=rows))
    if cuda:  # the device's busy time against the wall time: what the host's launches and syncs leave idle
        busy = sum(e.self_device_time_total for e in averages) / 1e6
        print(f"--- device busy {busy:.2f} s of {wall:.2f} s ({busy / wall:.0%}); top operators by host time")
        print(averages.table(sort_by="self_cpu_time_total", row_limit=rows))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=5, help="timed runs of each backend (alternating)")
    ap.add_argument("--rollouts", type=int, default=3,
                    help="rollouts per timed run (a rollout of the engine is ~60 ms)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's own choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: both backends on the GPU")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="float32",
                    help="precision of both sides: float32 weights, bf16 (engine: bf16 copies of float32 weights; "
                    "generate: the model cast to bf16), or both pairs in one run")
    ap.add_argument("--bf16-policy", action="store_true",
                    help="also time a policy loaded in bf16 (model.policy.dtype: bfloat16): the engine with dtype "
                    "model (bf16 arithmetic) and dtype auto against generate on that model")
    ap.add_argument("--continuous-batching", action="store_true",
                    help="also time transformers' generate_batch (continuous batching) as a second anchor")
    ap.add_argument("--cb-settings", type=json.loads, default={},
                    help="ContinuousBatchingConfig fields for that anchor, as JSON (default: TRL's, "
                    "max_memory_percent 0.5)")
    ap.add_argument("--profile", default=None, metavar="BACKEND",
                    help="after the timed runs, one more rollout of BACKEND (a name the runs print: engine-bf16, "
                    "hf, ...) under torch.profiler, and its top operators by device time (CPU time on a CPU)")
    ap.add_argument("--engine-settings", type=json.loads, default={},
                    help='EngineRollout arguments for every engine run, as JSON (e.g. \'{"max_batch_size": 512}\')')
    ap.add_argument("--without-graphs", action="store_true",
                    help="add the engine with cuda_graphs=False (eager decode steps on a GPU) and its ratio line")
    ap.add_argument("--with-mkl", action="store_true",
                    help="add the float32 engine with its matrices packed through MKL instead of this CPU's choice")
    ap.add_argument("--with-torch-ops", action="store_true",
                    help="add the float32 engine with torch's operators around its products instead of rlflow's "
                    "compiled ones (rlflow.rollout.decode_ops) and its ratio line")
    ap.add_argument("--with-rows", action="store_true",
                    help="add the engine with attention='rows' (a cache per row) and the ratio line of the engine over "
                    "it")
    ap.add_argument("--without-split", action="store_true",
                    help="add the engine with split_stragglers=False and its ratio line")
    ap.add_argument("--only", default=None, metavar="NAMES",
                    help="time only these backends (comma-separated names the runs print: engine-bf16,hf-bf16, ...); "
                    "ratio lines need both sides")
    ap.add_argument("--fresh-prompts", action="store_true",
                    help="every timed run (and the warm-up, and the profile) takes other prompts of the file (the next "
                    "--prompts rows, wrapping around), as every rollout of a training run does: shape-keyed caches "
                    "(cuDNN's attention plans, the allocator's blocks) then meet new shapes, as in training")
    ap.add_argument("--full-warmup", action="store_true",
                    help="warm up with one full-size rollout of each backend, not a 2-prompt one: on a GPU the first "
                    "batch-sized rollout pays for kernel selection and the caching allocator's growth")
    ap.add_argument("--no-cudnn-attention", action="store_true",
                    help="turn cuDNN's attention kernel off for every backend (the engine turns it off around its own "
                    "calls): on Hopper GPUs torch picks it for a masked scaled_dot_product_attention and builds an "
                    "execution plan per shape, and model.generate's 64 x 8 x 512 rollout failed inside it on an H200 "
                    "(torch 2.11)")
    args = ap.parse_args(argv)
    if args.no_cudnn_attention:
        torch.backends.cuda.enable_cudnn_sdp(False)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.continuous_batching import ContinuousBatchingRollout
    from benchmarks.plain_generate import PlainGenerateRollout
    from rlflow.rollout import prepack
    from rlflow.rollout.base import SamplingParams
    from rlflow.rollout.engine import EngineRollout
    from rlflow.rollout.fused import FusedDecoder

    if args.threads:
        torch.set_num_threads(args.threads)
    if not Path(args.model).exists():
        raise FileNotFoundError(
            f"--model {args.model} does not exist; build it with 'python tools/make_tiny_model.py --out {args.model}'"
        )
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model).eval().to(args.device)
    tok = AutoTokenizer.from_pretrained(args.model)
    pool = load_prompts(args.data, tok, args.prompts * (args.repeats + 2) if args.fresh_prompts else args.prompts,
                        at_most=args.fresh_prompts)
    if len(pool) < args.prompts:
        raise ValueError(f"{args.data} has only {len(pool)} prompts, --prompts asks for {args.prompts}")

    def block(r: int) -> list[list[int]]:  # the prompts of timed run r (the same for every run without --fresh-prompts)
        if not args.fresh_prompts:
            return pool
        return [pool[(r * args.prompts + i) % len(pool)] for i in range(args.prompts)]

    prompts = block(args.repeats)  # the warm-up's
    stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
    params = SamplingParams(args.temperature, args.top_p, args.top_k, args.max_tokens, stop)
    def engine(**kwargs):  # --engine-settings, then the variant's own options
        return EngineRollout(**{"seed": args.seed, **args.engine_settings, **kwargs})

    backends = {}
    if args.dtype in ("float32", "both"):
        backends.update({"hf": (PlainGenerateRollout(), model), "engine": (engine(), model)})
        if args.continuous_batching:
            backends["cb"] = (ContinuousBatchingRollout(**args.cb_settings), model)
    if args.dtype in ("bfloat16", "both"):
        half = copy.deepcopy(model).to(torch.bfloat16)
        backends.update({"hf-bf16": (PlainGenerateRollout(), half),
                         "engine-bf16": (engine(dtype="bfloat16"), model)})
        if args.continuous_batching:
            backends["cb-bf16"] = (ContinuousBatchingRollout(**args.cb_settings), half)
    if args.bf16_policy:  # the policy itself in bf16: generate on it, the engine in its dtype and with auto
        if "hf-bf16" not in backends:
            backends["hf-bf16"] = (PlainGenerateRollout(), copy.deepcopy(model).to(torch.bfloat16))
        policy = backends["hf-bf16"][1]
        backends.update({"engine-bf16-policy": (engine(), policy),
                         "engine-bf16-policy-auto": (engine(dtype="auto"), policy)})
    variants = [(suffix, option) for flag, suffix, option in VARIANTS if getattr(args, flag)]
    engines = [(name, b, m) for name, (b, m) in backends.items() if name.startswith("engine")]
    backends.update({f"{name}-{suffix}": (engine(dtype=b.dtype, **option), m)
                     for suffix, option in variants for name, b, m in engines})
    if args.with_mkl and "engine" in backends:
        backends["engine-mkl"] = (engine(), model)
    if args.with_torch_ops and "engine" in backends:
        backends["engine-torch-ops"] = (engine(), model)
    if args.only:
        wanted = args.only.split(",")
        unknown = [name for name in wanted if name not in backends]
        if unknown:
            ap.error(f"--only {','.join(unknown)}: not among this run's backends ({', '.join(backends)})")
        backends = {name: backends[name] for name in wanted}
    if args.profile is not None and args.profile not in backends:
        ap.error(f"--profile {args.profile}: not one of this run's backends ({', '.join(backends)})")
    warmup = (prompts, args.n) if args.full_warmup else (prompts[:2], 2)  # prompts and group size
    def kernel(name: str):  # applied wherever a variant's decoder may pack (bind, any call)
        if name.endswith("-mkl"):  # packs through MKL
            return mock.patch.object(prepack, "float32_kernel", lambda: "mkl")
        if name.endswith("-torch-ops"):  # keeps torch's operators around the products
            return mock.patch.object(FusedDecoder, "_compiled_ops_apply", lambda self: False)
        return contextlib.nullcontext()

    for name, (b, m) in backends.items():
        with kernel(name):
            b.bind(m, tok)
            run_once(b, warmup[0], params, warmup[1])
    backends = {name: b for name, (b, _) in backends.items()}
    rates: dict[str, list[float]] = {name: [] for name in backends}
    cuda = args.device == "cuda"
    working: dict[str, float] = {name: 0.0 for name in backends}  # GiB a rollout allocates above what was held before
    for r in range(args.repeats):
        for name, backend in backends.items():
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                held = torch.cuda.memory_allocated()
            with kernel(name):
                seconds, tokens, lengths = run_once(backend, block(r), params, args.n, args.rollouts)
            if cuda:
                working[name] = max(working[name], (torch.cuda.max_memory_allocated() - held) / 2 ** 30)
            rates[name].append(tokens / seconds)
            print(f"run {r + 1} {name:6s}: {tokens} tokens in {seconds:.2f} s = {tokens / seconds:.1f} tok/s "
                  f"(mean length {statistics.mean(lengths):.1f}, max {max(lengths)})", flush=True)
    for name, backend in backends.items():  # the engine's CUDA graphs (rlflow.rollout.graphs), where it made any
        graphed = getattr(backend, "_graphed", None)
        if graphed is not None:
            print(f"{name}: decode steps as CUDA graphs, {len(graphed.buckets)} buckets of rows "
                  f"({', '.join(map(str, sorted(graphed.buckets)))}) captured in {graphed.capture_seconds:.2f} s")
    if args.profile:
        profile_rollout(backends[args.profile], block(args.repeats + 1), params, args.n, cuda)
    if cuda:  # KV cache, logits and activations: what a rollout adds to the loaded weights at its peak
        print("peak GPU memory of a rollout above the memory held before it: "
              + ", ".join(f"{name} {gib:.2f} GiB" for name, gib in working.items()))
    med = {name: statistics.median(v) for name, v in rates.items()}
    out: dict[str, float] = {f"{k}_tok_s": v for k, v in med.items()}
    where = f"{torch.get_num_threads()} threads" if args.device == "cpu" else args.device
    print(f"settings: {args.prompts} prompts x {args.n}, {args.max_tokens} max tokens, T={args.temperature}, "
          f"top_p {args.top_p}, top_k {args.top_k}; {where}"
          + ("; other prompts in every run" if args.fresh_prompts else ""))
    pairs = [("engine", "hf", "")] if "engine" in med else []
    if "engine-bf16" in med:
        pairs.append(("engine-bf16", "hf-bf16", "-bf16"))
        if "hf" in med:
            pairs.append(("engine-bf16", "hf", "-bf16-over-float32-generate"))
    pairs += [(fast, "hf-bf16", f"-{fast[7:]}") for fast in ("engine-bf16-policy", "engine-bf16-policy-auto")
              if fast in med]
    pairs += [(fast, cb, f"{label}-over-continuous-batching") for fast, cb, label in
              (("engine", "cb", ""), ("engine-bf16", "cb-bf16", "-bf16")) if cb in med]
    pairs += [(fast, f"{fast}-{suffix}", f"{fast[6:]}-over-{suffix}") for suffix, _ in variants
              for fast in ("engine", "engine-bf16") if f"{fast}-{suffix}" in med]
    pairs += [(f"{fast}-{suffix}", anchor, f"{fast[6:]}-{suffix}") for suffix, _ in variants  # a variant's own lead
              for fast, anchor in (("engine", "hf"), ("engine-bf16", "hf-bf16")) if f"{fast}-{suffix}" in med]
    if "engine-mkl" in med:
        pairs.append(("engine", "engine-mkl", "-over-mkl"))
    if "engine-torch-ops" in med:
        pairs.append(("engine", "engine-torch-ops", "-over-torch-ops"))
    for fast, anchor, label in [p for p in pairs if p[0] in med and p[1] in med]:  # --only may leave one side out
        ratio = med[fast] / med[anchor]
        # robust to load drifting between runs
        paired = statistics.median(e / h for e, h in zip(rates[fast], rates[anchor]))
        print(f"rollout {fast}/{anchor} speedup: {ratio:.2f}x ({fast} {med[fast]:.1f} tok/s, {anchor} "
              f"{med[anchor]:.1f} tok/s, median of {args.repeats} runs x {args.rollouts} rollouts; median of paired "
              f"run ratios {paired:.2f}x; {where})")
        out[f"ratio{label}"], out[f"paired_ratio{label}"] = ratio, paired
    return out


if __name__ == "__main__":
    main()
