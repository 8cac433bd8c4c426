"""Peak memory and time of one packed training step on SmolLM2, by pack length: rlflow's packed attention against
the dense-mask path.

A step is what ``rlflow fit`` runs per micro-batch: the packed forward to the last hidden state, chunked log-probs
and entropies of the completion tokens (:func:`rlflow.training.packing.packed_completion_logprobs`,
``chunk_size`` 1024) and the backward pass of ``-mean(log-prob) - 0.001 * mean(entropy)``, with gradient
checkpointing, the fast RMSNorm backward, float32 master weights and bf16 autocast where the CPU multiplies bf16 in
hardware (``--precision``), as in ``configs/smollm2_gsm8k_cpu.yaml``. Variants:

* ``packed``: rlflow's packed attention (:mod:`rlflow.training.pack_attention`);
* ``dense``: transformers' own sdpa path for packed position ids, with its ``tokens x tokens`` block-diagonal mask
  (the anchor). Plain packs only.

Packs (``--tokens``, default 2k to 16k): sequences of 256 to 2,048 tokens (prompts of 64 to 256), the last one cut
to fill the pack exactly; ``--share-prompts``: groups of 4 completions (128 to 1,536 tokens) behind one prompt (128
to 512), ``packed`` only; ``--seq-len``: one sequence per pack, as long as the pack. Each pack and variant runs in
two fresh processes: one times the step, one measures its memory. The measured peak is the process's peak resident set
(``VmHWM``, reset just before the step) above its resident set then (model loaded, batch built), so it counts the
gradients (a constant) and every activation. That process runs with glibc's mmap threshold fixed at 256 KiB
(``MALLOC_MMAP_THRESHOLD_``): every block of that size or more is mapped on its own and returned to the system
when freed, so the peak follows the live tensors. glibc's default raises the threshold as blocks are freed (up to
32 MiB) and keeps freed blocks below it in its heap, which makes peaks jump by hundreds of MiB from one pack size
to the next (``--malloc-default`` measures that way); the fixed threshold costs time, hence the separate timing.
``--recipe`` instead times the recipe's own short packs (4 GSM8K prompts with the chat template x 4 completions of
20 to 64 tokens, shared prompts, no checkpointing): this checkout against ``--baseline REV``'s
``rlflow/training/packing.py`` (and ``pack_attention.py`` where REV has it), each step in alternating processes.

    python benchmarks/bench_pack_memory.py                        # packs of 2k, 4k, 8k, 16k tokens
    python benchmarks/bench_pack_memory.py --seq-len --tokens 4096 16384
    python benchmarks/bench_pack_memory.py --recipe --baseline HEAD~1 --repeats 5

Simplifications: one step per measurement (no warm-up) outside ``--recipe``; token ids are random (attention
and matrix sizes, not values, set the cost).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = ROOT / "checkpoints" / "smollm2-135m-instruct"
DATA = ROOT / "tests" / "data" / "train_example.jsonl"
MIB = 2**20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak() -> None:
    """Start the process's peak resident set (``VmHWM``) afresh at its current size (Linux's ``clear_refs``), so
    what loading the model touched does not count."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _use_packing_from(source_dir: str) -> None:
    """Import ``rlflow.training.packing`` (and ``pack_attention`` where present) from ``source_dir``: the
    baseline's files, written there by the parent, replace this checkout's before anything imports them."""
    import importlib.util

    for name in ("pack_attention", "packing"):
        path = Path(source_dir) / f"{name}.py"
        if path.exists():
            spec = importlib.util.spec_from_file_location(f"rlflow.training.{name}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)


def mixed_lengths(rng: random.Random, tokens: int) -> list[tuple[int, int]]:
    """(prompt, completion) lengths of sequences of 256-2,048 tokens filling ``tokens`` exactly."""
    out, left = [], tokens
    while left > 0:
        n = min(rng.randint(256, 2048), left)
        prompt = min(rng.randint(64, 256), n - 1) if n > 1 else 1
        out.append((prompt, max(n - prompt, 0)))
        left -= n
    return [(p, c) for p, c in out if c > 0] or [(1, tokens - 1)]


def experiences(spec: dict, vocab: int) -> list:
    """The pack's experiences for ``spec`` (``layout``: mix, share or seq-len; ``tokens``)."""
    from rlflow.data.experience import Experience

    rng = random.Random(spec["tokens"])
    ids = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    made = []
    if spec["layout"] == "seq-len":
        made = [(ids(256), ids(spec["tokens"] - 256), 0)]
    elif spec["layout"] == "mix":
        made = [(ids(p), ids(c), i) for i, (p, c) in enumerate(mixed_lengths(rng, spec["tokens"]))]
    else:  # groups of 4 behind one prompt, the last completion cut to fill the pack
        left, group = spec["tokens"], 0
        while left > 1:
            prompt = ids(min(rng.randint(128, 512), left - 1))
            left -= len(prompt)
            for _ in range(4):
                if left <= 0:
                    break
                c = min(rng.randint(128, 1536), left)
                made.append((prompt, ids(c), group))
                left -= c
            group += 1
    return [Experience(p, c, [0.0] * len(c), 0.0, 1.0, g, "stop", 0) for p, c, g in made]


def recipe_experiences(tokenizer) -> list:
    """The recipe's rollout step: 4 GSM8K prompts with the chat template, 4 completions of 20-64 tokens each."""
    from rlflow.data.experience import Experience

    rng = random.Random(0)
    rows = [json.loads(line) for line in DATA.open()][:4]
    out = []
    for g, row in enumerate(rows):
        prompt = list(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])
        for _ in range(4):
            c = [rng.randrange(100, tokenizer.vocab_size) for _ in range(rng.randint(20, 64))]
            out.append(Experience(prompt, c, [0.0] * len(c), 0.0, 1.0, g, "stop", 0))
    return out


def _load(args: argparse.Namespace, checkpointing: bool):
    import torch

    from rlflow.models.loading import enable_activation_checkpointing, load_causal_lm
    from rlflow.models.rms_norm import use_fast_rms_norm
    from rlflow.rollout.hardware import bf16_faster

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_causal_lm(str(args.model), "float32", "sdpa")
    use_fast_rms_norm(model)
    if checkpointing:
        enable_activation_checkpointing(model)
    model.train()
    bf16 = args.precision == "bf16" or (args.precision == "auto" and bf16_faster(torch.device("cpu")))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    return model, autocast, bf16


def _step(model, batch, autocast) -> float:
    """One forward + backward; returns its seconds."""
    from rlflow.training.packing import packed_completion_logprobs

    start = time.perf_counter()
    with autocast:
        logprobs, entropy = packed_completion_logprobs(model, batch, chunk_size=1024)
    mask = batch["completion_mask"]
    loss = -(logprobs[mask].mean() + 0.001 * entropy[mask].mean())
    loss.backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def child(args: argparse.Namespace) -> dict:
    """One measurement (``--child`` spec), printed as JSON."""
    spec = json.loads(args.child)
    if spec.get("packing_from"):
        _use_packing_from(spec["packing_from"])
    import contextlib

    import rlflow.training.packing as packing

    model, autocast, bf16 = _load(args, checkpointing=spec["layout"] != "recipe")
    if spec["layout"] == "recipe":
        from transformers import AutoTokenizer

        exps = recipe_experiences(AutoTokenizer.from_pretrained(args.model))
    else:
        exps = experiences(spec, model.get_input_embeddings().num_embeddings)
    share = spec["layout"] in ("share", "recipe")
    if spec["variant"] == "dense":  # transformers' own packed path: no rlflow attention
        packing._varlen_attention = lambda model, batch: contextlib.nullcontext({})
    batch = packing.collate_packed(exps, share_prompts=share)
    tokens = int(batch["input_ids"].shape[1])
    if spec["layout"] == "recipe":
        _step(model, batch, autocast)  # warm-up
        times = [_step(model, batch, autocast) for _ in range(args.steps)]
        return {**spec, "tokens": tokens, "seconds": statistics.median(times), "bf16": bf16}
    base = _rss_bytes()
    _reset_peak()
    seconds = _step(model, batch, autocast)
    peak = _peak_bytes() - base
    return {**spec, "tokens": tokens, "sequences": len(exps), "peak_bytes": int(peak), "seconds": seconds,
            "bf16": bf16}


def spawn(args: argparse.Namespace, spec: dict, measure: str = "time") -> dict | None:
    """Run one child process: ``measure`` "memory" with the mapped allocations of the module docstring, "time"
    with glibc's allocator as it comes."""
    cmd = [sys.executable, __file__, "--child", json.dumps(spec), "--model", str(args.model), "--threads",
           str(args.threads), "--precision", args.precision, "--steps", str(args.steps)]
    env = dict(os.environ)
    if measure == "memory" and not args.malloc_default:  # every block from 256 KiB up mapped on its own and
        env["MALLOC_MMAP_THRESHOLD_"] = str(256 * 1024)  # unmapped when freed: the peak follows live tensors
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        print(f"  {spec}: failed (exit {out.returncode}): {out.stderr.strip().splitlines()[-1:]}", flush=True)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory_table(args: argparse.Namespace) -> None:
    layout = "seq-len" if args.seq_len else "share" if args.share_prompts else "mix"
    variants = ["packed"] if layout == "share" else ["packed", "dense"]
    print(f"{'tokens':>7} {'seqs':>5} {'variant':8} {'peak MiB':>9} {'step s':>8}", flush=True)
    rows: dict[tuple[int, str], dict] = {}
    for tokens in args.tokens:
        for variant in variants:
            if variant == "dense" and tokens > args.dense_max_tokens:
                print(f"{tokens:7d} {'':>5} {variant:8} skipped (over --dense-max-tokens {args.dense_max_tokens})")
                continue
            spec = {"layout": layout, "variant": variant, "tokens": tokens}
            result, timed = spawn(args, spec, "memory"), spawn(args, spec, "time")
            if result is None or timed is None:
                continue
            result["seconds"] = timed["seconds"]
            rows[tokens, variant] = result
            print(f"{result['tokens']:7d} {result['sequences']:5d} {variant:8} {result['peak_bytes'] / MIB:9.0f} "
                  f"{result['seconds']:8.1f}", flush=True)
    precision = "bf16 autocast" if any(r["bf16"] for r in rows.values()) else "float32"
    print(f"layout {layout}, {precision}, gradient checkpointing, {args.threads} threads, model {args.model}")
    for tokens in args.tokens:
        new, old = rows.get((tokens, "packed")), rows.get((tokens, "dense"))
        if new and old:
            print(f"{tokens:7d} tokens: packed/dense peak {new['peak_bytes'] / old['peak_bytes']:.2f}, "
                  f"time {new['seconds'] / old['seconds']:.2f}")


def recipe_speed(args: argparse.Namespace) -> None:
    """This checkout against ``--baseline``'s packing, alternating, ``--repeats`` processes each."""
    with tempfile.TemporaryDirectory() as baseline:
        for name in ("packing", "pack_attention"):
            shown = subprocess.run(["git", "show", f"{args.baseline}:rlflow/training/{name}.py"], cwd=ROOT,
                                   capture_output=True, text=True)
            if shown.returncode == 0:
                Path(baseline, f"{name}.py").write_text(shown.stdout)
        times: dict[str, list[float]] = {"baseline": [], "current": []}
        for _ in range(args.repeats):
            for side in times:
                spec = {"layout": "recipe", "variant": side, "packing_from": baseline if side == "baseline" else ""}
                result = spawn(args, spec)
                if result is not None:
                    times[side].append(result["seconds"])
                    print(f"  {side:8} {result['tokens']} tokens: {result['seconds'] * 1000:.0f} ms", flush=True)
    base, cur = (statistics.median(times[s]) for s in ("baseline", "current"))
    print(f"recipe step (median of {args.repeats} processes x {args.steps} steps): baseline {args.baseline} "
          f"{base * 1000:.0f} ms, current {cur * 1000:.0f} ms, current/baseline {cur / base:.3f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=MODEL)
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    p.add_argument("--seq-len", action="store_true", help="one sequence per pack, as long as the pack")
    p.add_argument("--share-prompts", action="store_true", help="groups of 4 completions behind one prompt")
    p.add_argument("--dense-max-tokens", type=int, default=16384, help="longest pack the dense variant runs")
    p.add_argument("--recipe", action="store_true", help="time the recipe's short packs against --baseline")
    p.add_argument("--baseline", default="HEAD", help="git revision whose packing --recipe compares against")
    p.add_argument("--repeats", type=int, default=3, help="--recipe: processes per side")
    p.add_argument("--steps", type=int, default=3, help="--recipe: timed steps per process (after one warm-up)")
    p.add_argument("--precision", choices=["auto", "bf16", "32"], default="auto")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--malloc-default", action="store_true",
                   help="measure with glibc's adaptive mmap threshold (peaks then include freed memory its heap keeps)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    if not args.model.exists():
        raise SystemExit(f"{args.model} is missing: python tools/get_smollm2.py")
    recipe_speed(args) if args.recipe else memory_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
