r"""Benchmark: rlflow's speed on a real model against this machine's physical limits, in one run.

Five parts (``--parts``, all by default), each set against a limit measured in the same run::

    python benchmarks/bench_roofline.py                      # SmolLM2 at configs/smollm2_gsm8k_cpu.yaml's settings
    python benchmarks/bench_roofline.py --threads 1 --parts bandwidth matmul decode train

1. **bandwidth**: a STREAM-like copy, ``dst.copy_(src)`` of two ``--bandwidth-mib`` float32 tensors (far larger
   than the caches), counted as bytes read + written over the time, best of ``--repeats``; on the benchmark's
   threads (and on one thread when that is more than one).
2. **matmul**: ``F.linear`` GFLOP/s (``2 m k n`` FLOPs, best of ``--repeats``) in float32 and, where the CPU
   multiplies bfloat16 natively (AMX or AVX512-BF16; :func:`rlflow.rollout.hardware.native_bf16`) or the recipe
   trains in ``bf16-mixed``, bfloat16, at a
   ``--square`` cube and at the training step's shapes (a ``pack_max_length``-token pack through the q/o, gate/up and
   down projections, a ``logprob_chunk_size`` chunk through the LM head). A dtype's peak is its best figure.
3. **decode**: the ``engine`` backend sampling ``--prompts`` x ``--n`` completions of up to ``--max-tokens``
   tokens at the recipe's temperature and decode dtype (``--decode-dtype``; the recipe's ``auto`` is bf16 weight
   copies where the CPU multiplies bf16 natively). Each decode step is timed (the fused forward alone), and the
   decode loop as the rollout's time less its prefills (the forward plus sampling and bookkeeping), per step.
   Limits per step: the **memory roofline**, the bytes a step must read at least (every weight matrix once, in the
   decode dtype, plus the KV cache: each group's real prompt tokens once and each row's own generated tokens;
   :func:`state_reads`) over the measured copy bandwidth; and the **compute floor**, the step's FLOPs
   (:func:`benchmarks.bench_flops.model_flops` at the rows' real context lengths) over the decode dtype's matmul
   peak. ``share`` is limit time / measured time. ``model.generate`` (:mod:`benchmarks.plain_generate`) on the same
   rows, with the model cast to the decode dtype, is the anchor (tokens/s ratio). Last, the step's matrix products
   alone (:func:`products_alone`: the fused decoder's own prepacked products of all rows, back to back, nothing
   between them) against the roofline of the weights' bytes: the ceiling the GEMM kernels set on the forward.
4. **train**: one forward + backward of the recipe's packed training step (the decode part's completions, or
   random ones of ``--max-tokens`` tokens, packed into ``pack_max_length`` tokens with a group's prompt once, as
   ``rlflow fit`` packs them; under ``torch.autocast`` bf16 when the recipe's precision is ``bf16-mixed``; with the
   recipe's ``model.update.reuse_freed_memory`` as ``rlflow fit`` applies it, or ``--reuse-freed-memory``), against
   the matmul peak of its dtype. Model FLOPs (:func:`train_flops`): 3 x (2 x the layers' linear weights x the packed
   tokens + 2 x the LM head's weights x the completion tokens, the only positions the chunked head multiplies +
   4 x layers x width x the (query, key) pairs the packed attention computes).
5. **step**: a GRPO step (rollout + judge + train) of ``rlflow fit`` with the recipe as shipped (``--max-tokens``
   passed through) against ``trl.GRPOTrainer`` on the same model, rows, reward and settings, by running
   ``benchmarks/bench_step.py`` (each framework in its own subprocess; ``--step-steps`` steps, the first left out,
   ``--step-repeats`` runs each, bf16 compute on both sides when the recipe trains in ``bf16-mixed``).

The last lines are a table: each figure, the limit or anchor it is set against, and the share or ratio, then the
load average before and after. Timings on a machine shared with other processes move by tens of per cent: the
limits are measured in the same run as the figures, the figures are medians of ``--repeats`` runs (the limits their
best), and the engine alternates with ``generate`` so that load hits both.

Simplifications: CPU only; the memory roofline counts the weight matrices and the KV cache, not the embedding
rows, norms or the sampler's ``[rows, vocab]`` logits; decode FLOPs and times count the decode steps only (the
prompts' prefill is left out of the per-step figures, not of the tokens/s); the copy bandwidth is STREAM's convention
(a write-allocate cache reads the destination too, which the figure does not count).
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if not __package__:  # run as ``python benchmarks/<name>.py``: the repository root, for ``benchmarks.`` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_flops import causal_pairs, linear_weights, model_flops  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "configs/smollm2_gsm8k_cpu.yaml"
PARTS = ("bandwidth", "matmul", "decode", "train", "step")


# ------------------------------------------------------------------------------------------------ settings
def recipe_settings(path: str | Path) -> dict:
    """The settings of an rlflow config this benchmark follows (its defaults where the config leaves one out)."""
    import yaml

    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f) or {}
    data, model, trainer = config.get("data") or {}, config.get("model") or {}, config.get("trainer") or {}
    rollout = data.get("rollout") or {}
    init = rollout.get("init_args") or {} if isinstance(rollout, dict) else {}
    update = model.get("update") or {}
    return {
        "model": model.get("model_path", "checkpoints/smollm2-135m-instruct"),
        "data": data.get("train_data_path", "tests/data/train_example.jsonl"),
        "prompts": data.get("global_batch_size", 4), "n": data.get("prompt_repeat_k", 4),
        "temperature": (data.get("sampling") or {}).get("temperature", 1.0),
        "decode_dtype": init.get("dtype", "model"), "precision": str(trainer.get("precision", "32-true")),
        "pack_max_length": update.get("pack_max_length", 4096), "chunk": update.get("logprob_chunk_size", 1024),
        "reuse_freed_memory": update.get("reuse_freed_memory"),
    }


def parse_args(argv=None) -> argparse.Namespace:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=RECIPE)
    known, _ = pre.parse_known_args(argv)
    recipe = recipe_settings(known.config) if Path(known.config).exists() else {}
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=RECIPE, help="the rlflow config whose settings are measured (the recipe)")
    ap.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which parts to run")
    ap.add_argument("--model", help="Hugging Face model directory (default: the recipe's)")
    ap.add_argument("--data", help="jsonl with a 'prompt' field (default: the recipe's training data)")
    ap.add_argument("--prompts", type=int, help="prompts per rollout (default: the recipe's global_batch_size)")
    ap.add_argument("--n", type=int, help="completions per prompt (default: the recipe's prompt_repeat_k)")
    ap.add_argument("--max-tokens", type=int, default=48, help="most new tokens per completion")
    ap.add_argument("--temperature", type=float, help="sampling temperature (default: the recipe's; 0: greedy)")
    ap.add_argument("--decode-dtype", help="the engine's dtype option (default: the recipe's)")
    ap.add_argument("--precision", help="training precision, bf16-mixed, 32-true or auto (default: the recipe's)")
    ap.add_argument("--pack-max-length", type=int, help="training pack size in tokens (default: the recipe's)")
    ap.add_argument("--chunk", type=int, help="log-prob chunk of the LM head (default: the recipe's)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, as rlflow fit runs)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per figure (medians; best for the limits)")
    ap.add_argument("--bandwidth-mib", type=int, default=256, help="MiB of each tensor of the copy")
    ap.add_argument("--square", type=int, default=2048, help="side of the square matmul")
    ap.add_argument("--step-steps", type=int, default=3, help="GRPO steps per run of the step part (first left out)")
    ap.add_argument("--step-repeats", type=int, default=1, help="runs of each framework in the step part")
    ap.add_argument("--reuse-freed-memory", choices=("on", "off"),
                    help="model.update.reuse_freed_memory for the train part (default: the recipe's)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.reuse_freed_memory is not None:
        args.reuse_freed_memory = args.reuse_freed_memory == "on"
    for key, value in recipe.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    defaults = recipe_settings(os.devnull)  # a config without those keys: the benchmark's own defaults
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.precision == "auto":  # what rlflow fit trains in on this CPU (rlflow.training.trainer)
        from rlflow.training.trainer import auto_precision

        args.precision = auto_precision("cpu")[0]
    return args


# ----------------------------------------------------------------------------------------------- timings
def best_time(fn, repeats: int) -> float:
    """Shortest of ``repeats`` timed calls of ``fn`` after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def copy_bandwidth(mib: int, repeats: int, threads: int | None = None) -> float:
    """Bytes/s of ``dst.copy_(src)`` for two ``mib``-MiB float32 tensors, counted as read + written, best of
    ``repeats``; on ``threads`` torch threads (None: as set)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        src = torch.ones(mib * 2**20 // 4)  # written once: every page touched before the timing
        dst = torch.zeros_like(src)
        return 2 * src.numel() * src.element_size() / best_time(lambda: dst.copy_(src), repeats)
    finally:
        torch.set_num_threads(before)


def matmul_rate(m: int, k: int, n: int, dtype: torch.dtype, repeats: int) -> float:
    """FLOP/s of ``F.linear(x [m, k], w [n, k])`` (``2 m k n`` FLOPs) in ``dtype``, best of ``repeats``."""
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    return 2.0 * m * k * n / best_time(lambda: F.linear(x, w), repeats)


def matmul_shapes(config, pack_tokens: int, chunk: int, square: int) -> list[tuple[str, int, int, int]]:
    """``(label, m, k, n)`` of the square product and of the training step's products for a model ``config``."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return [
        (f"{square}^3 square", square, square, square),
        (f"q/o projection {pack_tokens}x{hidden}x{hidden}", pack_tokens, hidden, hidden),
        (f"gate/up projection {pack_tokens}x{hidden}x{inter}", pack_tokens, hidden, inter),
        (f"down projection {pack_tokens}x{inter}x{hidden}", pack_tokens, inter, hidden),
        (f"LM head chunk {chunk}x{hidden}x{config.vocab_size}", chunk, hidden, config.vocab_size),
    ]


# ----------------------------------------------------------------------------------- the limits' arithmetic
def weight_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of every weight matrix (the LM head included, tied or not) in ``dtype``: what a decode step reads."""
    return linear_weights(model) * torch.empty(0, dtype=dtype).element_size()


def kv_column_bytes(config, dtype: torch.dtype) -> int:
    """Bytes of one token's keys and values over all layers in ``dtype``."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_layer = 2 * config.num_key_value_heads * head_dim  # keys and values
    return config.num_hidden_layers * per_layer * torch.empty(0, dtype=dtype).element_size()


def state_reads(state) -> tuple[int, int]:
    """``(KV columns, (query, key) pairs)`` of the decode step about to run on the engine's ``state``
    (:class:`~rlflow.rollout.decode_state.DecodeState` or :class:`~rlflow.rollout.decode_state.LaneStates`).

    Columns are what the step must read at least: each group's real prompt tokens once (its rows share them) and each
    row's own generated tokens, the one fed now included. Pairs are per row: its prompt plus its own tokens."""
    columns = pairs = 0
    for s in getattr(state, "states", [state]):
        prompt = torch.isfinite(s.prompt_bias).sum(1)  # [groups]: real prompt tokens, the shared head included
        fed = torch.full_like(prompt, s.fed) if s.fed is not None else s.group_len.to(prompt.dtype)
        own = fed + 1
        columns += int((prompt + s.n * own).sum())
        pairs += int((s.n * (prompt + own)).sum())
    return columns, pairs


def pack_work(experiences: list, share_prompts: bool) -> tuple[int, int, int]:
    """``(tokens, predicted tokens, attended (query, key) pairs)`` of one pack as
    :func:`rlflow.training.packing.collate_packed` lays it out: with ``share_prompts`` the prompt head common to
    the pack's groups once (attended causally), each group's prompt tail once (over the head and itself), each
    completion over its prompt and its own tokens; without, each sequence whole and causal. Predicted tokens are
    the completion tokens (the positions the LM head multiplies)."""
    from rlflow.training.packing import prompt_units, shared_head_length

    units = prompt_units(experiences, 1 << 62, share_prompts)
    prompts = [experiences[unit[0]].prompt_ids for unit in units]
    head = shared_head_length(prompts) if share_prompts else 0
    tokens, predicted, pairs = head, 0, causal_pairs(head)
    for prompt, unit in zip(prompts, units):
        p = len(prompt)
        tokens += p - head
        pairs += causal_pairs(p) - causal_pairs(head)
        for i in unit:
            c = len(experiences[i].completion_ids)
            tokens, predicted, pairs = tokens + c, predicted + c, pairs + c * p + causal_pairs(c)
    return tokens, predicted, pairs


def train_flops(model: torch.nn.Module, packs: list[tuple[int, int, int]]) -> float:
    """Forward + backward FLOPs (3 forwards) of packs of :func:`pack_work` ``(tokens, predicted, pairs)``: the
    layers' linear weights over every packed token, the LM head over the predicted tokens only, attention over the
    pairs."""
    head = model.get_output_embeddings().weight.numel()
    body = linear_weights(model) - head
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    width = config.num_attention_heads * head_dim
    forward = sum(2.0 * body * tokens + 2.0 * head * predicted + 4.0 * config.num_hidden_layers * width * pairs
                  for tokens, predicted, pairs in packs)
    return 3 * forward


# ------------------------------------------------------------------------------------------------- decode
class DecodeTrace:
    """Times an :class:`~rlflow.rollout.engine.EngineRollout`'s decode steps and prefills (its own methods wrapped
    on the instance) and records each step's rows and reads (:func:`state_reads`)."""

    def __init__(self, engine) -> None:
        self.steps: list[tuple[float, int, int, int]] = []  # (seconds, rows, KV columns, pairs)
        self.prefill = 0.0
        decode_step, admit, head = engine._decode_step, engine._admit, engine._prefill_head

        def timed_step(state, pending, pos, decoder=None):
            columns, pairs = state_reads(state)
            start = time.perf_counter()
            logits = decode_step(state, pending, pos, decoder)
            self.steps.append((time.perf_counter() - start, pending.shape[0], columns, pairs))
            return logits

        def timed(fn):
            def run(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.prefill += time.perf_counter() - start
            return run

        engine._decode_step, engine._admit, engine._prefill_head = timed_step, timed(admit), timed(head)

    def reset(self) -> None:
        self.steps, self.prefill = [], 0.0


def decode_dtype_of(model: torch.nn.Module, choice: str) -> torch.dtype:
    from rlflow.rollout.engine import decode_dtype

    return decode_dtype(choice, next(model.parameters()).device) or next(model.parameters()).dtype


def products_alone(decoder, rows: int, repeats: int) -> float:
    """Seconds of one decode step's matrix products and nothing else: every layer's q/k/v, o (with its residual),
    gate/up and down (with its residual) and the LM head, through the fused decoder's own (prepacked) weights and
    product functions, on ``rows`` rows of random inputs, back to back (the weights streamed from memory as in a
    step; best of ``repeats`` runs of 5 steps). What the decode forward would take if everything between its
    products took no time: the ceiling the GEMM kernels set."""
    from rlflow.rollout.fused import _linear, _residual

    decoder.prepack(rows)
    g = torch.Generator().manual_seed(0)
    first = decoder.layers[0]
    x = torch.randn(rows, decoder.embed.shape[1], generator=g).to(decoder.dtype)
    attn = torch.randn(rows, decoder.num_heads * decoder.head_dim, generator=g).to(decoder.dtype)
    act = torch.randn(rows, first.inter, generator=g).to(decoder.dtype)
    head_in = x.float() if decoder.head_fp32 else x

    def steps() -> None:
        for _ in range(5):
            for layer in decoder.layers:
                _linear(x, layer.qkv_w, layer.qkv_b)
                _residual(x, attn, layer.o_w, layer.o_b)
                _linear(x, layer.gate_up_w, layer.gate_up_b)
                _residual(x, act, layer.down_w, layer.down_b)
            _linear(head_in, decoder.lm_head_w, decoder.lm_head_b)

    with torch.inference_mode():
        return best_time(steps, repeats) / 5


def measure_decode(args, model, tok, prompts, limits: dict) -> dict:
    """The decode part: the engine's rollouts (per-step trace) alternating with ``generate``'s, medians."""
    from benchmarks.plain_generate import PlainGenerateRollout
    from rlflow.rollout.base import SamplingParams
    from rlflow.rollout.engine import EngineRollout

    dtype = decode_dtype_of(model, args.decode_dtype)
    stop = [tok.eos_token_id] if tok.eos_token_id is not None else []
    params = SamplingParams(args.temperature, 1.0, 0, args.max_tokens, stop)
    engine = EngineRollout(seed=args.seed, dtype=args.decode_dtype)
    engine.bind(model, tok)
    trace = DecodeTrace(engine)
    anchor_model = copy.deepcopy(model).to(dtype) if dtype != next(model.parameters()).dtype else model
    anchor = PlainGenerateRollout()
    anchor.bind(anchor_model, tok)
    runs: dict[str, list] = {"engine": [], "generate": []}
    completions = None
    for r in range(args.repeats + 1):  # the first of each: warm-up (weight copies, packing, allocator)
        trace.reset()
        start = time.perf_counter()
        groups = engine.generate(prompts, params, n=args.n)
        seconds = time.perf_counter() - start
        completions = completions or groups
        tokens = sum(len(c.token_ids) for g in groups for c in g)
        if r:
            runs["engine"].append((seconds, tokens, trace.prefill, list(trace.steps)))
        start = time.perf_counter()
        anchor_groups = anchor.generate(prompts, params, n=args.n)
        if r:
            runs["generate"].append((time.perf_counter() - start, sum(len(c.token_ids) for g in anchor_groups
                                                                      for c in g)))
    out = summarise_decode(args, model, dtype, runs, limits) | {"completions": completions}
    if engine._kept_decoder is not None:  # the fused decoder of the runs above
        out["products_s"] = products_alone(engine._kept_decoder[1], args.prompts * args.n, args.repeats)
        if "bandwidth" in limits:
            out["weights_roofline_s"] = weight_bytes(model, dtype) / limits["bandwidth"]
    return out


def summarise_decode(args, model, dtype: torch.dtype, runs: dict, limits: dict) -> dict:
    """Medians of the decode runs and their limits per step (the limits missing where their part did not run)."""
    weights, column = weight_bytes(model, dtype), kv_column_bytes(model.config, dtype)
    loop, forward, roof_mem, roof_compute, step_bytes = [], [], [], [], []
    for seconds, _, prefill, steps in runs["engine"]:
        loop.append((seconds - prefill) / len(steps))
        forward.append(statistics.median(s for s, *_ in steps))
        bytes_per_step = [weights + columns * column for _, _, columns, _ in steps]
        step_bytes.append(statistics.mean(bytes_per_step))
        if "bandwidth" in limits:
            roof_mem.append(statistics.mean(bytes_per_step) / limits["bandwidth"])
        peak = limits.get(f"peak_{dtype_name(dtype)}")
        if peak:
            roof_compute.append(statistics.mean(model_flops(model, rows, pairs) for _, rows, _, pairs in steps) / peak)
    engine_rate = statistics.median(t / s for s, t, *_ in runs["engine"])
    generate_rate = statistics.median(t / s for s, t in runs["generate"])
    out = {
        "dtype": dtype_name(dtype), "rows": args.prompts * args.n, "steps": len(runs["engine"][0][3]),
        "loop_s": statistics.median(loop), "forward_s": statistics.median(forward),
        "bytes_per_step": statistics.median(step_bytes), "engine_tok_s": engine_rate,
        "generate_tok_s": generate_rate,
    }
    if roof_mem:
        out["roofline_s"] = statistics.median(roof_mem)
    if roof_compute:
        out["compute_floor_s"] = statistics.median(roof_compute)
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ------------------------------------------------------------------------------------------------ training
def training_batches(args, model, prompts: list[list[int]], completions) -> list[tuple[tuple, dict]]:
    """The recipe's packs of ``prompts`` x ``n`` experiences (the decode part's completions, else random tokens):
    per pack, its :func:`pack_work` and its collated batch."""
    from rlflow.data.experience import Experience
    from rlflow.training.packing import collate_packed, pack_experiences, varlen_supported

    gen = torch.Generator().manual_seed(args.seed)
    experiences = []
    for i, prompt in enumerate(prompts):
        for s in range(args.n):
            ids = completions[i][s].token_ids if completions else torch.randint(
                model.config.vocab_size, (args.max_tokens,), generator=gen).tolist()
            experiences.append(Experience(prompt, list(ids), [0.0] * len(ids), 0.0, 1.0 if s % 2 else -1.0, i,
                                          "length", 0))
    share = varlen_supported(model)
    return [(pack_work(pack, share), collate_packed(pack, share_prompts=share))
            for pack in pack_experiences(experiences, args.pack_max_length, share_prompts=share)]


def measure_training(args, model, packs: list[tuple[tuple, dict]], limits: dict) -> dict:
    """The train part: median seconds of one forward + backward over all packs, FLOPs, share of the peak."""
    from rlflow.training.host_memory import reuse_freed_memory
    from rlflow.training.packing import packed_completion_logprobs

    reuse_freed_memory(args.reuse_freed_memory, torch.device("cpu"))  # as rlflow fit's training process does
    bf16 = args.precision.startswith("bf16")
    model.train()

    def step():
        model.zero_grad(set_to_none=True)
        for _, batch in packs:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                logprobs, _ = packed_completion_logprobs(model, batch, args.temperature or 1.0, args.chunk)
            (logprobs * batch["completion_mask"]).sum().backward()

    step()  # warm-up
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    model.eval()
    seconds, flops = statistics.median(times), train_flops(model, [work for work, _ in packs])
    dtype = "bfloat16" if bf16 else "float32"
    out = {"seconds": seconds, "flops": flops, "dtype": dtype, "packs": len(packs),
           "tokens": sum(work[0] for work, _ in packs)}
    if limits.get(f"peak_{dtype}"):
        out["share"] = flops / seconds / limits[f"peak_{dtype}"]
    return out


# -------------------------------------------------------------------------------------------------- step
def step_command(args) -> list[str]:
    """``benchmarks/bench_step.py`` at the recipe's settings with ``--max-tokens`` on both sides."""
    rows = args.prompts * args.n
    command = [
        sys.executable, str(ROOT / "benchmarks" / "bench_step.py"), "--config", args.config, "--model", args.model,
        "--data", args.data, "--prompts", str(args.prompts), "--group", str(args.n), "--max-tokens",
        str(args.max_tokens), "--micro-batch", str(rows), "--steps", str(args.step_steps), "--warmup", "1",
        "--repeats", str(args.step_repeats), "--seed", str(args.seed),
        f"--rlflow-args=--data.sampling.max_tokens={args.max_tokens}",
    ]
    if args.precision.startswith("bf16"):
        command.append("--bf16")
    if args.threads:
        command += ["--threads", str(args.threads)]
    return command


def measure_step(args) -> dict:
    """The step part: bench_step.py's median seconds per GRPO step of rlflow and of TRL."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(step_command(args), capture_output=True, text=True, env=env, cwd=ROOT, check=False)
    found = dict(re.findall(r"^(rlflow|trl): median ([0-9.]+) s/step", proc.stdout, flags=re.M))
    for line in proc.stdout.splitlines():  # bench_step's own lines: each run's step times, the speed-up
        if line.startswith(("run ", "step rlflow/trl")):
            print(f"step: {line}", flush=True)
    if proc.returncode or len(found) != 2:
        raise RuntimeError(f"bench_step.py failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}"
                           f"{proc.stderr[-3000:]}")
    return {"rlflow_s": float(found["rlflow"]), "trl_s": float(found["trl"])}


# --------------------------------------------------------------------------------------------------- main
def cpu_name() -> str:
    """The CPU's model name (``lscpu``'s), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def table(rows: list[tuple[str, ...]]) -> str:
    """``rows`` of (figure, measured, limit or anchor, share or ratio) as aligned columns under a header."""
    rows = [("figure", "measured", "limit / anchor", "share / ratio"), *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def run_limits(args, config, rows: list, results: dict) -> dict:
    """The bandwidth and matmul parts: the limits (bytes/s, FLOP/s per dtype) and their table rows."""
    from rlflow.rollout.hardware import native_bf16

    limits: dict = {}
    threads = torch.get_num_threads()
    if "bandwidth" in args.parts:
        limits["bandwidth"] = copy_bandwidth(args.bandwidth_mib, args.repeats)
        single = copy_bandwidth(args.bandwidth_mib, args.repeats, threads=1) if threads > 1 else limits["bandwidth"]
        results.update(bandwidth=limits["bandwidth"], bandwidth_1_thread=single)
        rows.append((f"copy bandwidth, {threads} thread(s)", f"{limits['bandwidth'] / 1e9:.1f} GB/s", "", ""))
        if threads > 1:
            rows.append(("copy bandwidth, 1 thread", f"{single / 1e9:.1f} GB/s", "", ""))
        print(f"bandwidth: {limits['bandwidth'] / 1e9:.1f} GB/s on {threads} thread(s), {single / 1e9:.1f} GB/s on 1 "
              f"({args.bandwidth_mib} MiB copies)", flush=True)
    if "matmul" in args.parts:
        # bfloat16 where the CPU multiplies it natively, and wherever the training part trains in it (emulated or
        # not, the rate measured here is this CPU's limit for that training)
        bf16 = native_bf16(torch.device("cpu")) or args.precision.startswith("bf16")
        dtypes = [torch.float32] + ([torch.bfloat16] if bf16 else [])
        shapes = matmul_shapes(config, args.pack_max_length, args.chunk, args.square)
        for dtype in dtypes:
            name = dtype_name(dtype)
            rates = {label: matmul_rate(m, k, n, dtype, args.repeats) for label, m, k, n in shapes}
            for label, rate in rates.items():
                print(f"matmul {name} {label}: {rate / 1e9:.1f} GFLOP/s", flush=True)
            limits[f"peak_{name}"] = max(rates.values())
            results[f"matmul_{name}"] = rates
            training = [rate for label, rate in rates.items() if "square" not in label]
            rows += [(f"matmul {name}, {shapes[0][0]}", f"{rates[shapes[0][0]] / 1e9:.1f} GFLOP/s", "", ""),
                     (f"matmul {name}, training shapes", f"{min(training) / 1e9:.1f}-{max(training) / 1e9:.1f} "
                      "GFLOP/s", "", "")]
    results.update({k: v for k, v in limits.items() if k.startswith("peak_")})
    return limits


def decode_rows(d: dict, limits: dict) -> list[tuple[str, ...]]:
    """Table rows of the decode part's summary ``d``."""
    rows = []
    what = f"{d['rows']} rows, {d['dtype']}"
    for label, key in (("decode loop per step", "loop_s"), ("decode forward per step", "forward_s")):
        measured = f"{d[key] * 1e3:.1f} ms"
        if "roofline_s" in d:
            rows.append((f"{label} ({what})", measured, f"memory roofline {d['roofline_s'] * 1e3:.1f} ms "
                         f"({d['bytes_per_step'] / 1e6:.0f} MB / {limits['bandwidth'] / 1e9:.1f} GB/s)",
                         f"{d['roofline_s'] / d[key]:.2f}"))
        if "compute_floor_s" in d:
            peak = limits[f"peak_{d['dtype']}"]
            rows.append((f"{label} ({what})" if "roofline_s" not in d else "", "" if "roofline_s" in d else measured,
                         f"compute floor {d['compute_floor_s'] * 1e3:.1f} ms ({peak / 1e9:.0f} GFLOP/s)",
                         f"{d['compute_floor_s'] / d[key]:.2f}"))
        if "roofline_s" not in d and "compute_floor_s" not in d:
            rows.append((f"{label} ({what})", measured, "", ""))
    if "products_s" in d:
        roof = d.get("weights_roofline_s")
        rows.append((f"decode products alone per step ({what})", f"{d['products_s'] * 1e3:.1f} ms",
                     f"memory roofline of the weights {roof * 1e3:.1f} ms" if roof else "",
                     f"{roof / d['products_s']:.2f}" if roof else ""))
    rows.append((f"rollout tokens/s ({d['steps'] + 1} tokens at most)", f"{d['engine_tok_s']:.1f} tok/s",
                 f"model.generate {d['generate_tok_s']:.1f} tok/s", f"{d['engine_tok_s'] / d['generate_tok_s']:.2f}x"))
    return rows


def run_model_parts(args, rows: list, results: dict, limits: dict) -> None:
    """The decode and train parts on the model (float32 master weights, as rlflow fit loads the policy)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.bench_rollout import load_prompts

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    prompts = load_prompts(args.data, tok, args.prompts)
    completions = None
    if "decode" in args.parts:
        d = measure_decode(args, model, tok, prompts, limits)
        completions = d.pop("completions")
        results["decode"] = d
        rows += decode_rows(d, limits)
        print(f"decode: {d['loop_s'] * 1e3:.1f} ms per loop step, {d['forward_s'] * 1e3:.1f} ms per forward, "
              f"{d['engine_tok_s']:.1f} tok/s (generate {d['generate_tok_s']:.1f})", flush=True)
    if "train" in args.parts:
        t = measure_training(args, model, training_batches(args, model, prompts, completions), limits)
        results["train"] = t
        rate = t["flops"] / t["seconds"]
        peak = limits.get(f"peak_{t['dtype']}")
        rows.append((f"training fwd+bwd ({t['packs']} packs, {t['tokens']} tokens, {t['dtype']})",
                     f"{t['seconds']:.2f} s = {rate / 1e9:.1f} GFLOP/s",
                     f"{t['dtype']} matmul peak {peak / 1e9:.1f} GFLOP/s" if peak else "",
                     f"{t['share']:.2f}" if "share" in t else ""))
        print(f"training: {t['seconds']:.2f} s, {t['flops'] / 1e9:.1f} GFLOP, {rate / 1e9:.1f} GFLOP/s", flush=True)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoConfig

    if not Path(args.model).exists():
        raise FileNotFoundError(f"--model {args.model} does not exist (python tools/get_smollm2.py)")
    load = os.getloadavg()[0]
    threads = torch.get_num_threads()
    print(f"settings: {args.model}, {args.prompts} prompts x {args.n}, <= {args.max_tokens} new tokens, temperature "
          f"{args.temperature}, decode dtype {args.decode_dtype}, training {args.precision} in packs of "
          f"{args.pack_max_length} tokens; {threads} torch thread(s) on {cpu_name()} ({os.cpu_count()} CPUs)",
          flush=True)
    rows: list[tuple[str, ...]] = []
    results: dict = {"threads": threads}
    limits = run_limits(args, AutoConfig.from_pretrained(args.model), rows, results)
    if {"decode", "train"} & set(args.parts):
        run_model_parts(args, rows, results, limits)
    if "step" in args.parts:
        s = measure_step(args)
        results["step"] = s
        rows.append((f"GRPO step ({args.prompts} x {args.n}, <= {args.max_tokens} tokens)",
                     f"rlflow {s['rlflow_s']:.2f} s", f"TRL GRPOTrainer {s['trl_s']:.2f} s",
                     f"{s['trl_s'] / s['rlflow_s']:.2f}x"))
    print(f"\n{table(rows)}\n({threads} torch thread(s), {cpu_name()}, load average {load:.2f} -> "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs)")
    return results


if __name__ == "__main__":
    main()
