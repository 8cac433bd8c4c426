r"""Benchmark: a packed set's masked attention on a CPU, torch's 16-bit kernel against rlflow's float32 call.

Under ``bf16-mixed`` (or with a 16-bit model) the short attention sets of a packed training step
(:func:`rlflow.training.pack_attention._masked_sdpa`) would call ``scaled_dot_product_attention`` in bf16; rlflow
calls it on float32 copies instead and rounds the output to bf16 once. This times one forward + backward of each
at the shapes of a step (``rows`` sequences of ``queries`` queries over ``keys`` keys, GQA with SmolLM2's 9 query
and 3 key/value heads of 64), both under ``torch.autocast`` bf16 as a training step runs them::

    python benchmarks/bench_attention.py --threads 1
    python benchmarks/bench_attention.py --shapes 16x32x72 4x40x40 --heads 9 3 --dim 64

It prints, per shape, the median milliseconds of each and their ratio (16-bit / float32), and the largest
difference between the two outputs relative to the largest output value.

Simplifications: random states and a causal mask aligned to the last key (completions behind a prompt), not a real
pack's padding; medians over ``--repeats`` timed runs after 3 untimed ones.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

DEFAULT_SHAPES = ("16x32x72", "4x40x40", "8x32x72", "16x64x128", "8x200x256")


def states(rows: int, queries: int, keys: int, heads: int, kv_heads: int, dim: int, seed: int = 0):
    """Random float32 q, k, v (what the projections give under autocast after RoPE) and a causal mask."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, queries, dim, generator=gen, requires_grad=True)
    k, v = (torch.randn(rows, kv_heads, keys, dim, generator=gen, requires_grad=True) for _ in range(2))
    mask = torch.arange(keys)[None, :] <= torch.arange(keys - queries, keys)[:, None]
    return q, k, v, mask[None, None].expand(rows, 1, queries, keys)


def sixteen_bit(q, k, v, mask):
    """What autocast runs: the call in bf16."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)


def rlflow_call(q, k, v, mask):
    """rlflow's call: float32 inside the same autocast, the output rounded to bf16 once."""
    from rlflow.training.pack_attention import _masked_sdpa

    with torch.autocast("cpu", dtype=torch.bfloat16):
        return _masked_sdpa(q, k, v, mask, 0.125, 0.0, True)


def time_call(fn, tensors, repeats: int) -> float:
    """Median seconds of one forward + backward."""
    times = []
    for i in range(repeats + 3):
        start = time.perf_counter()
        fn(*tensors).float().sum().backward()
        if i >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(shape: str, heads: int, kv_heads: int, dim: int, repeats: int) -> dict:
    rows, queries, keys = (int(x) for x in shape.split("x"))
    tensors = states(rows, queries, keys, heads, kv_heads, dim)
    with torch.no_grad():
        a, b = sixteen_bit(*tensors).float(), rlflow_call(*tensors).float()
    gap = float((a - b).abs().max() / b.abs().max())
    bf16, fp32 = time_call(sixteen_bit, tensors, repeats), time_call(rlflow_call, tensors, repeats)
    return {"shape": shape, "bf16_ms": bf16 * 1e3, "float32_ms": fp32 * 1e3, "ratio": bf16 / fp32, "gap": gap}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="ROWSxQUERIESxKEYS each")
    ap.add_argument("--heads", type=int, nargs=2, default=(9, 3), metavar=("Q", "KV"))
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"{'rows x queries x keys':22} {'bf16 kernel ms':>15} {'rlflow float32 ms':>18} {'ratio':>7} {'max gap':>9}")
    results = []
    for shape in args.shapes:
        r = measure(shape, *args.heads, args.dim, args.repeats)
        results.append(r)
        print(f"{shape:22} {r['bf16_ms']:15.2f} {r['float32_ms']:18.2f} {r['ratio']:6.2f}x {r['gap']:9.1e}",
              flush=True)
    print(f"forward + backward, medians of {args.repeats}; {torch.get_num_threads()} thread(s)")
    return results


if __name__ == "__main__":
    main()
