r"""Benchmark: one decode step's attention of one layer, the engine's group cache against cascade attention.

The engine's decode attention (:func:`rlflow.rollout.decode_state.attend_cached`, ``group``) reads one cache per
GRPO group, its prompt then its rows' generated tokens interleaved, with all of the group's queries at once: each
query also meets the other rows' tokens (masked). Cascade attention (``cascade``, defined here)
attends the group's prompt with the group's queries and each row's own tokens with that row's queries, and merges
the two by their log-sum-exps; ``cascade-math`` is the same in float32 matrix products (no fused kernel);
``per-row`` is one fused call over a per-row copy of prompt and tokens, no mask (what ``model.generate``'s
attention reads: the prompt once per row), ``per-row-masked`` the same with a mask per row (what padded prompts
need; each row's queries of one key/value head as its sequence, so no grouped-query expansion);
``groups-of-one`` is the engine's own attention over a cache of groups of one row each (the prompt copied to each
row), the layout of the engine's ``attention: rows`` option. Every variant gets the same queries and keys, and runs
as the engine runs it, without cuDNN's attention kernel (:func:`rlflow.rollout.hardware.without_cudnn_attention`);
on a GPU ``group-cudnn`` and ``per-row-cudnn`` are ``group`` and ``per-row`` with it allowed::

    python benchmarks/bench_decode_attention.py --device cuda --dtype bfloat16
    python benchmarks/bench_decode_attention.py --shapes 64x8x48x511 16x8x1024x128

A shape is ``groups x n x prompt x generated``. Per shape and variant it prints the median microseconds of a call,
that times the model's layers (a decode step's attention), the bytes a call must read at least (each group's
prompt keys/values once, each row's own tokens once) over its time, and that rate as a share of the device's copy
rate (a ``copy_`` of 1 GiB, read plus write, measured in the same run); then each variant's ratio to ``group`` and
its largest difference from ``group``'s output, and the time of its first call at that shape (where a kernel
library builds and caches something per shape, as cuDNN does, that call pays for it).

Simplifications: random keys and queries, one layer, every row at the same number of generated tokens (the
engine's usual case), no padding in the prompts; the median is of calls after the first.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

if not __package__:  # run as ``python benchmarks/<name>.py``: the repository root, for ``rlflow`` imports
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlflow.rollout.decode_state import DecodeState, attend_cached  # noqa: E402
from rlflow.rollout.hardware import without_cudnn_attention  # noqa: E402

# ---- cascade attention (a candidate measured here, not what the engine runs): a group's prompt attended with the
# group's queries, each row's own tokens with that row's queries, the two softmaxes merged by their log-sum-exps
# (FlashInfer's and vLLM's cascade merge: out = w1 * out1 + w2 * out2, w = exp(lse - logaddexp(lse1, lse2))).

_KERNELS: dict[tuple[str, bool], bool] = {}  # (device type, masked) -> whether the fused kernel ran there


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
          scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[B, H, M, D]`` over ``k``/``v`` ``[B, H, N, D]`` in float32: ``(out, lse)``."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias.float()
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse[..., None]), v.float())
    return out.to(q.dtype), lse


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The same through one of torch's fused kernels (raises where none takes these inputs)."""
    aten = torch.ops.aten
    if q.device.type == "cuda":
        if bias is None and q.dtype in (torch.float16, torch.bfloat16):
            out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
            return out, lse
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, False, scale=scale)[:2]
        return out, lse[..., : q.shape[2]]
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=bias, scale=scale)
    return out, lse


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(q k^T * scale + bias) v, logsumexp(q k^T * scale + bias))`` for ``q`` ``[B, H, M, D]`` and
    ``k``/``v`` ``[B, H, N, D]`` (``bias`` broadcastable to ``[B, H, M, N]``, or None); the log-sum-exp is
    ``[B, H, M]`` float32. A fused kernel where one takes the inputs (tried once per device type and masking, the
    float32 maths from then on where it failed)."""
    key = (q.device.type, bias is not None)
    if _KERNELS.get(key, True):
        try:
            result = _fused(q, k, v, bias, scale)
            _KERNELS[key] = True
            return result
        except (RuntimeError, NotImplementedError):
            _KERNELS[key] = False
    return _math(q, k, v, bias, scale)


def merge(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """The attention over two disjoint key sets from each set's output ``[..., D]`` and log-sum-exp ``[...]``."""
    lse = torch.logaddexp(lse1, lse2)
    w1, w2 = torch.exp(lse1 - lse)[..., None], torch.exp(lse2 - lse)[..., None]
    return (out1.float() * w1 + out2.float() * w2).to(out1.dtype)


def cascade_attend(query: torch.Tensor, prompt_k: torch.Tensor, prompt_v: torch.Tensor,
                   prompt_bias: torch.Tensor | None, own_k: torch.Tensor, own_v: torch.Tensor,
                   own_bias: torch.Tensor | None, n: int, scale: float) -> torch.Tensor:
    """Cascade decode attention of ``query`` ``[rows, heads, D]`` (rows ``g * n + s``: sample ``s`` of group
    ``g``) over its group's prompt (``prompt_k``/``prompt_v`` ``[groups, kv_heads, P, D]``, ``prompt_bias``
    ``[groups, P]``: 0 where a row may look, -inf on padding; None: none) and its own tokens (``own_k``/``own_v``
    ``[rows, kv_heads, T, D]``, ``own_bias`` ``[rows, T]`` or None); returns ``[rows, heads * D]``."""
    rows, heads, dim = query.shape
    groups, kv_heads = prompt_k.shape[:2]
    rep = heads // kv_heads
    q_group = query.view(groups, n, kv_heads, rep, dim).transpose(1, 2).reshape(groups, kv_heads, n * rep, dim)
    bias = None if prompt_bias is None else prompt_bias[:, None, None, :].expand(groups, kv_heads, n * rep, -1)
    out_p, lse_p = attention_with_lse(q_group, prompt_k, prompt_v, bias, scale)
    out_p = out_p.view(groups, kv_heads, n, rep, dim).transpose(1, 2).reshape(rows, kv_heads, rep, dim)
    lse_p = lse_p.view(groups, kv_heads, n, rep).transpose(1, 2).reshape(rows, kv_heads, rep)
    q_row = query.view(rows, kv_heads, rep, dim)
    bias = None if own_bias is None else own_bias[:, None, None, :].expand(rows, kv_heads, rep, -1)
    out_g, lse_g = attention_with_lse(q_row, own_k, own_v, bias, scale)
    return merge(out_p, lse_p, out_g, lse_g).reshape(rows, heads * dim)


DEFAULT_SHAPES = ("16x8x48x32", "16x8x48x127", "32x8x48x64", "32x8x48x255", "32x8x48x511", "64x8x48x255",
                  "64x8x48x511", "16x8x1024x128", "4x16x200x1000")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def first_call(fn, device: torch.device) -> float:
    """Seconds of one call of ``fn`` (at a shape it has not met: what a kernel library's per-shape set-up costs)."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def timed(fn, device: torch.device, repeats: int, inner: int = 10) -> float:
    """Median seconds of one call of ``fn`` over ``repeats`` timings of ``inner`` calls (after one untimed)."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        sync(device)
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times)


def copy_rate(device: torch.device, repeats: int) -> float:
    """Bytes per second of a ``copy_`` of 1 GiB (256 MiB on a CPU), read plus written."""
    size = 2 ** 30 if device.type == "cuda" else 2 ** 28
    a = torch.empty(size // 4, dtype=torch.float32, device=device)
    b = torch.empty_like(a)
    return 2 * size / timed(lambda: b.copy_(a), device, repeats, inner=3)


def measure(shape: str, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, device: torch.device,
            repeats: int, layers: int, rate: float) -> list[dict]:
    groups, n, prompt, generated = (int(x) for x in shape.split("x"))
    rows, scale = groups * n, dim ** -0.5
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*size):
        return torch.randn(*size, generator=gen, dtype=torch.float32).to(device=device, dtype=dtype)

    prompt_k, prompt_v = rand(groups, kv_heads, prompt, dim), rand(groups, kv_heads, prompt, dim)
    own_k, own_v = rand(rows, kv_heads, generated, dim), rand(rows, kv_heads, generated, dim)
    query = rand(rows, heads, dim)
    # the engine's group cache with the same keys: prompt, then token t of row s at column t * n + s
    state = DecodeState(n, generated)
    state.add_groups(list(range(groups)), [prompt_k], [prompt_v], torch.ones(groups, prompt, device=device))
    for _ in range(generated - 1):
        state.begin_step()
        state.end_step()
    state.begin_step()
    for cache, own in ((state.k[0], own_k), (state.v[0], own_v)):
        region = cache[:, :, prompt: prompt + generated * n].view(groups, kv_heads, generated, n, dim)
        region.copy_(own.view(groups, n, kv_heads, generated, dim).permute(0, 2, 3, 1, 4))
    # the engine's cache in groups of one (one group per row, the prompt copied to each): rows' own layout
    singles = DecodeState(1, generated)
    singles.add_groups(list(range(rows)), [prompt_k.repeat_interleave(n, 0)], [prompt_v.repeat_interleave(n, 0)],
                       torch.ones(rows, prompt, device=device))
    for _ in range(generated - 1):
        singles.begin_step()
        singles.end_step()
    singles.begin_step()
    singles.k[0][:, :, prompt: prompt + generated] = own_k
    singles.v[0][:, :, prompt: prompt + generated] = own_v
    full_k = torch.cat([prompt_k.repeat_interleave(n, 0), own_k], dim=2)
    full_v = torch.cat([prompt_v.repeat_interleave(n, 0), own_v], dim=2)

    def group():
        return attend_cached(state, 0, query[:, :, None], scale).reshape(rows, heads * dim)

    def ones():
        return attend_cached(singles, 0, query[:, :, None], scale).reshape(rows, heads * dim)

    def cascaded():
        return cascade_attend(query, prompt_k, prompt_v, None, own_k, own_v, None, n, scale)

    def cascaded_math():
        saved = dict(_KERNELS)
        _KERNELS.update({(device.type, False): False, (device.type, True): False})
        try:
            return cascaded()
        finally:
            _KERNELS.clear()
            _KERNELS.update(saved)

    def per_row():
        out = F.scaled_dot_product_attention(query[:, :, None], full_k, full_v, scale=scale, enable_gqa=True)
        return out.reshape(rows, heads * dim)

    row_bias = torch.zeros(rows, 1, 1, full_k.shape[2], dtype=dtype, device=device)  # what padded prompts need

    def per_row_masked():  # a row's rep queries per key/value head as its "sequence": no GQA, one mask per row
        q = query.view(rows, kv_heads, heads // kv_heads, dim)
        out = F.scaled_dot_product_attention(q, full_k, full_v, attn_mask=row_bias, scale=scale)
        return out.reshape(rows, heads * dim)

    itemsize = torch.empty((), dtype=dtype).element_size()
    least = 2 * itemsize * kv_heads * dim * (groups * prompt + rows * generated)  # keys and values, once each
    with without_cudnn_attention(device):
        reference = group().float()
    results = []
    variants = [("group", group), ("cascade", cascaded), ("cascade-math", cascaded_math), ("per-row", per_row),
                ("per-row-masked", per_row_masked), ("groups-of-one", ones)]
    if device.type == "cuda":  # the others run as the engine runs them, without cuDNN's attention kernel
        variants += [("group-cudnn", group), ("per-row-cudnn", per_row)]
    for name, fn in variants:
        kernels = contextlib.nullcontext() if name.endswith("-cudnn") else without_cudnn_attention(device)
        try:
            with kernels:
                first = first_call(fn, device)
                seconds = timed(fn, device, repeats)
                diff = (fn().float() - reference).abs().max().item()
        except Exception as error:  # noqa: BLE001 - a variant a device cannot run is reported, the others go on
            print(f"{shape:>16s} {name:14s} failed: {type(error).__name__}: {str(error).splitlines()[0][:120]}")
            continue
        results.append({"shape": shape, "variant": name, "us": seconds * 1e6, "diff": diff,
                        "share": least / seconds / rate, "first_ms": first * 1e3})
    base = next((r["us"] for r in results if r["variant"] == "group"), None)
    for r in results:
        ratio = f"{base / r['us']:.2f}x group" if base else ""
        print(f"{shape:>16s} {r['variant']:14s} {r['us']:9.1f} us  x{layers} layers {r['us'] * layers / 1e3:7.2f} ms  "
              f"{r['share']:6.1%} of copy rate  {ratio:>12s}  max diff {r['diff']:.2e}  first call "
              f"{r['first_ms']:.1f} ms", flush=True)
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="groups x n x prompt x generated")
    ap.add_argument("--heads", type=int, nargs=2, default=(16, 8), help="query and key/value heads (Qwen3-0.6B's)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=28, help="layers of the model (a step's attention is this many)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rate = copy_rate(device, args.repeats)
    where = torch.cuda.get_device_name() if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"copy rate {rate / 1e9:.0f} GB/s (read + write); {args.dtype}, heads {args.heads[0]}/{args.heads[1]} x "
          f"{args.dim}; {where}")
    results = []
    for shape in args.shapes:
        results += measure(shape, *args.heads, args.dim, dtype, device, args.repeats, args.layers, rate)
    return results


if __name__ == "__main__":
    main()
