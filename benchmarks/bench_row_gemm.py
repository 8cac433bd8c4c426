"""Benchmark: rlflow's row GEMM against MKL's and oneDNN's packed float32 products, on a decoder's matrix shapes.

Each kernel multiplies ``--rows`` rows by ``--layers`` copies of each matrix shape in turn (a decode step's
products: every layer's weights read once from memory, not from cache), after a 256 MiB write that evicts the
caches. Printed per shape and in total over a step: milliseconds, the weights' bytes over that time (GB/s), and
each kernel's ratio against MKL's (the product rlflow's decoder takes on AVX-512 CPUs where the row GEMM is off); beside
them this run's copy bandwidth (the memory roofline's yardstick of ``bench_roofline.py``). The default shapes are
SmolLM2-135M's (q/k/v, o, gate/up, down, 30 layers; the LM head once).

    python benchmarks/bench_row_gemm.py                   # 16 rows, torch's threads
    python benchmarks/bench_row_gemm.py --rows 1 4 64 --threads 1
    python benchmarks/bench_row_gemm.py --packing          # and packing a step's matrices after an optimizer step
"""

from __future__ import annotations

import argparse
import time

import torch

from rlflow.rollout import prepack, row_gemm

#: SmolLM2-135M-Instruct's matrices as the fused decoder holds them: (name, in, out, copies per step)
SMOLLM2 = [("qkv", 576, 960, 30), ("o", 576, 576, 30), ("gate_up", 576, 3072, 30), ("down", 1536, 576, 30),
           ("lm_head", 576, 49152, 1)]


def kernels(weight_t: torch.Tensor, rows: int) -> dict:
    """``name -> product(x)`` for each kernel this torch and CPU have, over ``weight_t`` (``[in, out]``)."""
    out = weight_t.shape[1]
    found = {"torch.mm": lambda x: torch.mm(x, weight_t)}
    if prepack._mkl():
        w = weight_t.t().contiguous()
        mkl = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
        found["mkl"] = lambda x: torch.ops.mkl._mkl_linear(x, mkl, w, None, rows)
    if prepack._onednn():
        onednn = prepack._pack_for("onednn", weight_t, rows)
        found["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], "")
    if row_gemm.available():
        panels = prepack._pack_for("row_gemm", weight_t, rows)
        found["row_gemm"] = lambda x: row_gemm.mm(x, panels, out)
    return found


def copy_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Bytes read plus written per second by the best of ``repeats`` copies of ``mib`` MiB."""
    a = torch.ones(mib * 2 ** 18)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - start)
    return 2 * a.numel() * 4 / best


def time_shape(k: int, n: int, copies: int, rows: int, repeats: int, evict: torch.Tensor,
               min_mib: int = 64) -> dict[str, float]:
    """Median seconds per product of each kernel over ``copies`` distinct ``[k, n]`` matrices (at least ``min_mib``
    MiB of them, so that they come from memory)."""
    count = max(copies, -(-(min_mib << 20) // (k * n * 4)))
    gen = torch.Generator().manual_seed(0)
    mats = [torch.randn(k, n, generator=gen) for _ in range(count)]
    per = [kernels(w, rows) for w in mats]
    x = torch.randn(rows, k, generator=gen)
    times = {}
    for name in per[0]:
        runs = []
        for _ in range(repeats):
            evict.add_(1.0)
            start = time.perf_counter()
            for products in per:
                products[name](x)
            runs.append((time.perf_counter() - start) / count)
        times[name] = sorted(runs)[len(runs) // 2]
    return times


def time_packing(shapes: list, repeats: int) -> dict[str, float]:
    """Median seconds to make the panels of every matrix of ``shapes`` (each ``copies`` times: what the engine packs
    after an optimizer step) from ``[out, in]`` weights with a norm weight folded in, three ways: straight
    (``row_gemm.pack_rows``, one pass), through torch's operators (the product with the norm weight, a transposing
    copy, then ``row_gemm.pack``: the decoder's packing without ``pack_rows``), and a plain copy of the same bytes
    (one read and one write of each matrix: the memory's limit for any packing). Both packings are checked to give
    the same panels."""
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(n, k, generator=gen), torch.rand(k, generator=gen) + 0.5)
               for _, k, n, copies in shapes for _ in range(copies)]
    ways = {"straight": lambda w, g: row_gemm.pack_rows([w], g),
            "torch ops": lambda w, g: row_gemm.pack((w * g).t().contiguous()),
            "copy": lambda w, g: w.clone()}
    w, g = weights[0]
    if not torch.equal(ways["straight"](w, g), ways["torch ops"](w, g)):
        raise AssertionError("pack_rows and torch's operators + pack made different panels")
    times = {}
    for name, make in ways.items():
        runs = []
        for _ in range(repeats):
            start = time.perf_counter()
            made = [make(w, g) for w, g in weights]
            runs.append(time.perf_counter() - start)
            del made
        times[name] = sorted(runs)[len(runs) // 2]
    return times


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[16], help="rows per product (a decode step's sequences)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=5, help="timed passes per kernel (medians)")
    ap.add_argument("--min-mib", type=int, default=64,
                    help="MiB of copies of each shape at least (more than the caches hold)")
    ap.add_argument("--shapes", default=None,
                    help="'name:in:out:copies,...' (default: SmolLM2-135M's, 30 layers and the LM head)")
    ap.add_argument("--packing", action="store_true",
                    help="also time packing a step's matrices after an optimizer step (straight, torch's ops, a copy)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = SMOLLM2 if not args.shapes else [
        (name, int(k), int(n), int(c)) for name, k, n, c in (s.split(":") for s in args.shapes.split(","))]
    evict = torch.zeros(64 << 20)  # 256 MiB
    bandwidth = copy_bandwidth()
    print(f"{torch.get_num_threads()} thread(s), {torch.backends.cpu.get_cpu_capability()}; copy bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s (256 MiB, bytes read + written); row GEMM: "
          f"{'yes' if row_gemm.available() else 'no (' + str(row_gemm.unsupported_reason()) + ')'}")
    results = {}
    for rows in args.rows:
        step: dict[str, float] = {}
        weights = 0
        for name, k, n, copies in shapes:
            times = time_shape(k, n, copies, rows, args.repeats, evict, args.min_mib)
            gb = k * n * 4
            weights += gb * copies
            cells = "  ".join(f"{kern} {t * 1e3:.3f} ms {gb / t / 1e9:.1f} GB/s" for kern, t in times.items())
            print(f"rows {rows:4d}  {name:8s} {cells}")
            for kern, t in times.items():
                step[kern] = step.get(kern, 0.0) + t * copies
        base = step.get("mkl")
        line = "  ".join(f"{kern} {t * 1e3:.1f} ms ({weights / t / 1e9:.1f} GB/s"
                         + (f", {base / t:.2f}x mkl)" if base else ")") for kern, t in step.items())
        print(f"rows {rows:4d}  a step ({weights / 1e6:.0f} MB of weights; memory roofline "
              f"{weights / bandwidth * 1e3:.1f} ms): {line}")
        results[rows] = step
    packing = None
    if args.packing and row_gemm.available():
        packing = time_packing(shapes, args.repeats)
        print(f"packing a step's matrices: straight {packing['straight'] * 1e3:.1f} ms, torch ops "
              f"{packing['torch ops'] * 1e3:.1f} ms ({packing['torch ops'] / packing['straight']:.2f}x straight's), "
              f"a copy of the bytes {packing['copy'] * 1e3:.1f} ms (straight at "
              f"{packing['copy'] / packing['straight']:.2f} of the copy's speed)")
    return {"bandwidth": bandwidth, "steps": results, "packing": packing}


if __name__ == "__main__":
    main()
