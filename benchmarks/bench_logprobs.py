"""Peak memory and time of per-token log-probs + entropy: chunked (``rlflow.training.logprobs``) against naive full
logits.

Each variant runs in a fresh subprocess, so one variant's high-water mark cannot hide another's. On CUDA the
peak is ``torch.cuda.max_memory_allocated`` above what was allocated before the call; on CPU it is the
process's peak resident set (``resource.getrusage``) above its resident set just before the call. Modes:
``forward`` (no grad: old/reference log-probs) and ``train`` (forward + backward of ``sum(logp) + sum(entropy)``).

The naive path holds several ``[tokens, vocab]`` float32 tensors (5 GB each at 8,192 x 151,936), more than a
small CPU box can spare: when its estimated footprint exceeds ``--max-gb`` the naive variant is measured at the
largest halving of ``--tokens`` that fits and scaled linearly (every naive tensor is ``tokens x vocab``); the
output marks such figures ``extrapolated``. The chunked variant is always measured at full size.

    python benchmarks/bench_logprobs.py                      # vocab 151,936, 8,192 tokens, both modes
    python benchmarks/bench_logprobs.py --device cuda --hidden 1024
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BYTES_PER_ELEMENT = 4  # float32 logits
#: [tokens, vocab] float32 tensors the naive path holds at its peak, measured on CPU (forward) and estimated (train).
NAIVE_TENSORS = {"forward": 3, "train": 6}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def worker(args: argparse.Namespace) -> dict:
    """Run one variant once and report its peak memory above the starting point, and its time."""
    import torch

    from rlflow.training.logprobs import naive_token_stats, token_stats_from_hidden

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    train = args.mode == "train"
    head = torch.nn.Linear(args.hidden, args.vocab, bias=False, device=device, dtype=dtype)
    head.weight.requires_grad_(train)
    hidden = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype).requires_grad_(train)
    targets = torch.randint(0, args.vocab, (args.tokens,), device=device)

    def run():
        with torch.set_grad_enabled(train):
            if args.variant == "chunked":
                lp, ent = token_stats_from_hidden(hidden, targets, head, 1.0, args.chunk_size)
            else:
                lp, ent = naive_token_stats(head(hidden), targets, 1.0)
            if train:
                (lp.sum() + ent.sum()).backward()
        return float(lp.detach().sum() + ent.detach().sum())

    if device.type == "cuda":
        run()  # warm-up (kernels, allocator)
        head.weight.grad = hidden.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        checksum = run()
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() - base
    else:
        base = _rss_bytes()
        start = time.perf_counter()
        checksum = run()
        elapsed = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    return {"variant": args.variant, "mode": args.mode, "tokens": args.tokens, "peak_bytes": int(peak),
            "seconds": elapsed, "checksum": checksum}


def spawn(args: argparse.Namespace, variant: str, mode: str, tokens: int) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--variant", variant, "--mode", mode, "--tokens", str(tokens),
           "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--chunk-size", str(args.chunk_size),
           "--device", args.device, "--dtype", args.dtype, "--threads", str(args.threads)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{variant}/{mode} at {tokens} tokens failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def naive_tokens_that_fit(args: argparse.Namespace, mode: str) -> int:
    if args.device != "cpu":
        return args.tokens
    budget = args.max_gb * 2**30 if args.max_gb else 0.5 * _available_bytes()
    tokens = args.tokens
    while tokens > 256 and NAIVE_TENSORS[mode] * tokens * args.vocab * BYTES_PER_ELEMENT > budget:
        tokens //= 2
    return tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--tokens", type=int, default=8_192)
    p.add_argument("--hidden", type=int, default=128,
                   help="hidden size of the LM head (cost only; memory is dominated by tokens x vocab)")
    p.add_argument("--chunk-size", type=int, default=1024)
    p.add_argument("--mode", choices=["forward", "train", "both"], default="both")
    p.add_argument("--device", default="cuda" if _cuda() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-gb", type=float, default=None,
                   help="CPU memory the naive variant may use (default: half of MemAvailable)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0

    gib = 2**30
    print(f"vocab={args.vocab} tokens={args.tokens} hidden={args.hidden} chunk_size={args.chunk_size} "
          f"device={args.device} dtype={args.dtype} threads={args.threads}")
    print(f"{'mode':8} {'variant':8} {'tokens':>7} {'peak GiB':>9} {'time s':>8}  note")
    ok = True
    for mode in (["forward", "train"] if args.mode == "both" else [args.mode]):
        chunked = spawn(args, "chunked", mode, args.tokens)
        n_tok = naive_tokens_that_fit(args, mode)
        naive = spawn(args, "naive", mode, n_tok)
        scale = args.tokens / n_tok
        print(f"{mode:8} {'chunked':8} {args.tokens:7d} {chunked['peak_bytes'] / gib:9.3f} "
              f"{chunked['seconds']:8.2f}  measured")
        print(f"{mode:8} {'naive':8} {n_tok:7d} {naive['peak_bytes'] / gib:9.3f} {naive['seconds']:8.2f}  measured")
        naive_peak = naive["peak_bytes"] * scale
        if scale != 1:
            print(f"{mode:8} {'naive':8} {args.tokens:7d} {naive_peak / gib:9.3f} {naive['seconds'] * scale:8.2f}  "
                  f"extrapolated x{scale:g} from {n_tok} tokens (every naive tensor is tokens x vocab)")
        ratio = chunked["peak_bytes"] / max(naive_peak, 1)
        verdict = "OK" if ratio <= 0.25 else "OVER the 1/4 target"
        ok &= ratio <= 0.25
        print(f"{mode:8} chunked/naive peak = {ratio:.3f} ({verdict})")
    return 0 if ok else 1


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing
        return False


if __name__ == "__main__":
    sys.exit(main())
