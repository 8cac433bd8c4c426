"""CUDA graphs over the fused decoder's decode step, piecewise: every operator between two attention calls replays
as one graph.

Why: on a GPU a decode step of a small model is bound by kernel launches, not by the maths: the fused decoder
(:mod:`rlflow.rollout.fused`) issues some twenty kernels per layer, each a few microseconds of work behind a launch
of about as long. A CUDA graph replays a recorded sequence of kernels with one launch. The attention between them
reads a KV cache whose width grows every step and whose rows change as groups finish
(:mod:`rlflow.rollout.decode_state`), so it stays eager, as vLLM's piecewise graphs keep it: a step is the graph of
the token embedding and layer 0's attention inputs, the eager attention of layer 0, the graph of layer 0's output
half and layer 1's attention inputs, and so on, ending with the graph of the last layer's output half, the final
norm and the LM head.

Graphs have static shapes: a step of ``rows`` rows runs the graphs captured for the smallest *bucket* of rows that
holds it (:data:`BUCKETS`: powers of two and the halves between them, so at most a third of a product is padding),
its inputs copied into the bucket's static buffers and the padding rows left as they are (each row's result
depends on that row alone; padding rows are never read). A bucket is captured the first time a step needs it,
after two warm-up runs on a side stream, all of its graphs before the step runs, so a failed capture leaves the
step to run eagerly with nothing written to the KV cache. Captures share one memory pool per bucket and replay in
the order they were captured. The graphs read the decoder's weight copies at fixed addresses: after an optimizer
step the engine copies the new weights into them (:meth:`~rlflow.rollout.fused.FusedDecoder.refresh`), so a run
captures each bucket once; a new decoder (weights moved, another dtype) gets new graphs.

On a CPU the same segments run eagerly (``capture="eager"``), each step's results copied into the same static
buffers: the tests check the bucketing and buffer plumbing there, and on CUDA that graphed steps equal eager ones.

Simplifications: decode steps only (prefills run eagerly: their shapes change with every batch of prompts); steps
of more rows than the engine's ``max_batch_size`` run eagerly; the rotary cos/sin lookup runs eagerly before the
first graph (it grows its table on the host).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rlflow.rollout.fused import FusedDecoder

#: Row counts graphs are captured for: 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and the halves between).
BUCKETS = tuple(sorted({1, 3} | {2 ** i for i in range(1, 14)} | {3 * 2 ** i for i in range(13)}))
CAPTURES = ("cuda", "eager")


class GraphCaptureError(RuntimeError):
    """A bucket's graphs could not be captured (the step is then run eagerly)."""


def bucket_for(rows: int, max_rows: int) -> int | None:
    """The smallest bucket of at least ``rows`` rows; None for more than ``max_rows`` rows (or than every bucket)."""
    return next((b for b in BUCKETS if b >= rows), None) if rows <= max_rows else None


def capture_kind(device: torch.device) -> str | None:
    """How graphs are made on ``device``: ``cuda`` on a CUDA GPU; None elsewhere (steps run as they are)."""
    return "cuda" if device.type == "cuda" else None


Segment = tuple[Callable[[], None], tuple[torch.Tensor, ...]]


def _eager(fn: Callable[..., tuple[torch.Tensor, ...]], inputs: Sequence[torch.Tensor], pool: Any,
           stream: Any) -> Segment:
    """``fn`` run now into outputs that each replay overwrites in place (a graph's static outputs, without one)."""
    outputs = fn(*inputs)

    def replay() -> None:
        for out, new in zip(outputs, fn(*inputs)):
            out.copy_(new)

    return replay, outputs


def _cuda(fn: Callable[..., tuple[torch.Tensor, ...]], inputs: Sequence[torch.Tensor], pool: Any,
          stream: Any) -> Segment:
    """``fn`` captured in a CUDA graph over ``inputs`` (static buffers), after two warm-up runs (cuBLAS and the
    allocator set themselves up outside the capture), all on ``stream``: one side stream for all of a decoder's
    captures (cuBLAS keeps a workspace per stream, which the graphs then read). ``capture_begin``/``capture_end``
    directly, not the ``torch.cuda.graph`` context, which synchronises the device and empties the allocator's cache
    at every capture, and a bucket is some thirty captures. The capture refuses unsafe calls of this thread only
    (``thread_local``): training in another thread (pipelined rollouts) goes on meanwhile."""
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn(*inputs)
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            outputs = fn(*inputs)
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return graph.replay, outputs


class _Bucket:
    """A bucket's static inputs and its segments (replay, static outputs), in step order."""

    def __init__(self, size: int, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, width: int) -> None:
        self.tokens = tokens.new_zeros((size,))
        self.cos = cos.new_zeros((size, *cos.shape[1:]))
        self.sin = sin.new_zeros((size, *sin.shape[1:]))
        self.attn_out = cos.new_zeros((size, width))
        self.segments: list[Segment] = []


class GraphedDecoder:
    """A :class:`~rlflow.rollout.fused.FusedDecoder`'s decode steps through piecewise graphs (module docstring)."""

    def __init__(self, decoder: FusedDecoder, max_rows: int, capture: str = "cuda") -> None:
        """
        Args:
            decoder: The fused decoder whose weight copies the graphs read.
            max_rows: Steps of more rows than this run eagerly (the engine's ``max_batch_size``).
            capture: ``cuda`` (CUDA graphs) or ``eager`` (the segments run as they are: CPU tests).
        """
        if capture not in CAPTURES:
            raise ValueError(f"GraphedDecoder capture must be one of {', '.join(CAPTURES)}; got {capture!r}")
        self.decoder = decoder
        self.max_rows = max_rows
        self.capture = _cuda if capture == "cuda" else _eager
        self.kind = capture
        self.stream = torch.cuda.Stream(decoder.embed.device) if capture == "cuda" else None
        self.buckets: dict[int, _Bucket] = {}
        self.capture_seconds = 0.0  # wall time spent capturing buckets (warm-ups included)

    def _segments(self, bucket: _Bucket) -> list[Segment]:
        """Capture the bucket's graphs: embedding + layer 0's attention inputs; each layer's output half + the
        next layer's attention inputs; the last layer's output half + the logits."""
        d, layers = self.decoder, self.decoder.layers
        pool = torch.cuda.graph_pool_handle() if self.kind == "cuda" else None

        def first(tokens, cos, sin):
            h = d.embed_tokens(tokens)
            return (h, *d.attention_inputs(layers[0], h, cos, sin))

        def middle(i: int):
            def run(h, out, cos, sin):
                h = d.after_attention(layers[i - 1], h, out)
                return (h, *d.attention_inputs(layers[i], h, cos, sin))
            return run

        def last(h, out):
            return (d.logits(d.after_attention(layers[-1], h, out)),)

        segments = [self.capture(first, (bucket.tokens, bucket.cos, bucket.sin), pool, self.stream)]
        for i in range(1, len(layers)):
            h = segments[-1][1][0]
            segments.append(self.capture(middle(i), (h, bucket.attn_out, bucket.cos, bucket.sin), pool, self.stream))
        segments.append(self.capture(last, (segments[-1][1][0], bucket.attn_out), pool, self.stream))
        return segments

    def _bucket(self, size: int, tokens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> _Bucket:
        """The bucket of ``size`` rows, captured now if it is new (:class:`GraphCaptureError` if that fails)."""
        bucket = self.buckets.get(size)
        if bucket is None:
            d = self.decoder
            bucket = _Bucket(size, tokens, cos, sin, d.num_heads * d.head_dim)
            start = time.perf_counter()
            try:
                bucket.segments = self._segments(bucket)
            except Exception as error:  # noqa: BLE001 - any failure to capture means: run eagerly
                raise GraphCaptureError(f"{type(error).__name__}: {error}") from error
            finally:
                self.capture_seconds += time.perf_counter() - start
            self.buckets[size] = bucket
        return bucket

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of one decode step, as :meth:`FusedDecoder.step` computes them (with
        ``select`` None): the bucket's graphs replayed between eager ``attend`` calls. Steps larger than every
        bucket run through the decoder as they are."""
        d, rows = self.decoder, tokens.shape[0]
        size = bucket_for(rows, self.max_rows)
        if size is None:
            return d.step(tokens, positions, attend)
        cos, sin = d.rope(torch.empty(0, dtype=d.dtype, device=tokens.device), positions)
        bucket = self._bucket(size, tokens, cos, sin)
        bucket.tokens[:rows].copy_(tokens)
        bucket.cos[:rows].copy_(cos)
        bucket.sin[:rows].copy_(sin)
        for idx, (replay, outputs) in enumerate(bucket.segments[:-1]):
            replay()
            _, q, k, v = outputs
            out = attend(idx, q[:rows], k[:rows], v[:rows], d.layers[idx].scaling)
            bucket.attn_out[:rows].copy_(out)
        replay, (logits,) = bucket.segments[-1]
        replay()
        return logits[:rows].clone()
