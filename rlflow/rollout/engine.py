"""The ``engine`` rollout backend: a decode loop of its own over the live transformers policy.

Why not ``model.generate``: GRPO samples ``n`` completions of every prompt, and ``generate`` prefills each of
the ``n`` copies separately, stores ``n`` copies of the prompt's keys and values and reads all of them on
every token, keeps finished rows in the batch until the longest one ends, and pays its general machinery
(logits processors, stopping criteria, mask building) on every token. This engine

* prefills each *distinct* prompt once and keeps one cache per group: its prompt's keys/values followed by the
  ``n`` rows' generated tokens (token-major), so a decode step's attention is one matrix product of the group's
  queries with its cache under a mask built when the group joins, one softmax and one product with the values
  ("cascade" sharing of the prompt: it is read once per group, not once per completion;
  :mod:`rlflow.rollout.decode_state`);
* runs continuous batching by groups: a finished sequence stops at once, a group's cache is freed when its last
  sequence ends (compaction is lazy and by whole groups, so the batch stays whole groups in order; the last rows
  of a mostly finished group go on as groups of one, ``split_stragglers``), and waiting prompts are prefilled and
  join the running batch as soon as there is room (``max_batch_size`` sequences);
* prefills the token prefix common to every prompt of the rollout (system prompt, instruction, chat-template
  head) once, and copies its keys/values in front of each group's own;
* decodes and prefills with its own forward of the live weights (:mod:`rlflow.rollout.fused`: q/k/v and gate/up
  folded into one matrix product each, no per-token module, hook, cache-object or mask machinery) for
  Qwen2/Qwen3/Llama-style models, and otherwise hands the model's forward its own attention function and state;
* with ``dtype: bfloat16`` (or ``auto`` where the device multiplies bfloat16 natively) decodes through bfloat16
  copies of float32 master weights, with bf16 KV caches and one SDPA call per layer for the decode attention,
  while training keeps float32: a decode step reads half the bytes and runs on the bf16 units (AMX on recent
  Xeons, tensor cores on GPUs). The behaviour log-probs are then the bf16 model's. The fused decoder (its weight
  copies, in whatever dtype) is kept across rollout calls while every parameter keeps its storage, in-place
  version counter and LoRA switches, and dropped by :meth:`EngineRollout.sync_weights` after every optimizer step
  (which a fused optimizer kernel takes without moving the version counters);
* samples (:mod:`rlflow.rollout.sampling`) with temperature / top-k / top-p and returns ``log_softmax(logits /
  temperature)`` of each taken token (before truncation, as :class:`~rlflow.rollout.base.Completion` specifies),
  stopping exactly at the first stop token (kept) or at ``max_tokens``; each row's uniform for its ``t``-th token is a
  pure function of the row's stream key and ``t`` (:mod:`rlflow.rollout.draws`), so a row samples the same tokens
  whatever rows share its batch and whenever it was admitted;
* yields each prompt's group as soon as its last completion finishes (:meth:`EngineRollout.stream`), so
  judging can overlap with the rest of the generation.
* inside :meth:`EngineRollout.keep_caches` (multi-turn rollouts) keeps each finished row's cache and continues
  a later prompt that extends it from that cache, prefilling only the appended tokens
  (:mod:`rlflow.rollout.continuation`);
* :meth:`EngineRollout.serve` takes its requests from a source polled between decode steps
  (:mod:`rlflow.rollout.requests`), so a multi-turn trajectory's next turn joins the running batch as soon as its
  tools have answered; groups of different sizes (a first turn's ``n``, later turns' one) decode side by side in
  lanes, one :class:`DecodeState` each, in one forward (:class:`LaneStates`).

Simplifications: the prompt regions of a batch are padded to the longest prompt and the generated-token
regions grow by doubling up to ``max_tokens`` (masked, exact, but not a paged block table); each query also
meets its group's other rows' tokens (masked: ``n`` times the arithmetic of that part: cheap next to the
per-operator cost over tens of generated tokens, the larger part of a step over hundreds; ``attention: rows``
avoids it, each row with its own copy of the prompt); only the prefix common
to *all* prompts of a call is shared across groups (no radix tree). The prefill without the fused forward uses
the model's own attention.
Decoding through the model's forward (architectures the fused path does not cover) needs attention modules
that go through transformers' attention interface, pass extra keyword arguments down to it (the engine hands
its :class:`DecodeState` over as ``rlflow_decode_state``) and call ``cache.update(k, v, layer_idx)``;
sliding-window and hybrid linear-attention models are refused. :meth:`EngineRollout.bind` checks this once per
model (:mod:`rlflow.rollout.engine_support`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from rlflow.log import warn
from rlflow.rollout.base import (
    Completion,
    Progress,
    RolloutBackend,
    SamplingParams,
    UnsupportedModelError,
    in_prompt_order,
)
from rlflow.rollout.continuation import SessionCache, merge_prefills, prefill_on_caches
from rlflow.rollout.decode_state import ATTENTION_NAME, DecodeState
from rlflow.rollout.draws import CallKeys, keyed_requests
from rlflow.rollout.engine_support import cache_kwargs, probe_error, static_unsupported_reason
from rlflow.rollout.fused import FusedDecoder, torch_norm_for
from rlflow.rollout.graphs import GraphCaptureError, GraphedDecoder, capture_kind
from rlflow.rollout.hardware import bf16_faster, inference_context
from rlflow.rollout.prepack import products_in_words
from rlflow.rollout.requests import DecodeRequest, ListSource, RequestSource, check_call
from rlflow.rollout.serving import ServeCall

DECODE_DTYPES = ("model", "float32", "bfloat16", "float16", "auto")
ATTENTION_LAYOUTS = ("groups", "rows")


def decode_dtype(choice: str, device: torch.device) -> torch.dtype | None:
    """The fused decoder's dtype for the engine's ``dtype`` option on ``device`` (None: the model's own)."""
    if choice == "auto":
        if bf16_faster(device):
            return torch.bfloat16
        return torch.float32 if device.type == "cpu" else None  # a CPU where bf16 is not faster: float32 copies
    return None if choice == "model" else getattr(torch, choice)


def common_prefix_len(prompts: list[list[int]]) -> int:
    """Length of the token prefix shared by every prompt, leaving at least one own token per prompt."""
    first, n = prompts[0], min(len(p) for p in prompts) - 1
    for other in prompts[1:]:
        n = next((i for i in range(n) if other[i] != first[i]), n)
    return n


class EngineRollout(CallKeys, RolloutBackend):
    """Rollout with a shared prompt cache per group and continuous batching on the live policy (faster than ``hf``)."""

    streams = True  # groups are yielded as they finish, so judging overlaps generation

    def __init__(self, max_batch_size: int = 256, prefill_batch_size: int = 16, seed: int | None = None,
                 fused: bool = True, min_shared_prefix: int = 16,
                 dtype: Literal["model", "float32", "bfloat16", "float16", "auto"] = "model",
                 norm: Literal["auto", "model", "torch"] = "auto", cuda_graphs: bool = True,
                 split_stragglers: bool = True, attention: Literal["groups", "rows"] = "groups") -> None:
        """
        Args:
            max_batch_size: Most sequences decoded together (bounds the KV cache's memory); a prompt's ``n``
                completions always join together, so at least ``n`` run at once.
            prefill_batch_size: Most distinct prompts prefilled in one forward pass.
            seed: Seed of the engine's sampling draws: every row samples from its own counter-based random stream
                (:mod:`rlflow.rollout.draws`), keyed by (seed, the engine's call count, the row), so what a row
                samples does not depend on the rows beside it; None keys each call by one draw from torch's global
                generator instead.
            fused: Decode with rlflow's own forward of the live weights (:mod:`rlflow.rollout.fused`) where the
                architecture is supported (Qwen2/Qwen3/Llama, unsharded); otherwise, or when False, decode steps
                call the model's forward with the engine's attention function.
            min_shared_prefix: Prefill the token prefix common to all prompts of a rollout once, and attend to it
                with one matrix product for all rows, when it is at least this long (0 disables it).
            dtype: Arithmetic of the fused decoder: ``model`` (the policy's own dtype, exact), ``float32``,
                ``bfloat16``, ``float16`` (a copy of the weights in that dtype, made per rollout call, so it always
                holds the current weights; training keeps the policy's dtype), or ``auto`` (``bfloat16`` where it is
                faster: a CUDA GPU with bf16, a CPU whose bf16 products measure >= 1.5x float32's, e.g. with AMX
                (:func:`~rlflow.rollout.hardware.bf16_faster`); ``float32`` on other CPUs, so a 16-bit policy
                decodes through float32 copies; the model's own on other GPUs). Lower precision halves the weight
                bytes a decode step reads; the rollout log-probs are then those of the rounded weights (see
                docs/performance.md, "bf16 decoding"). Decoding through the model's forward (no fused path) ignores
                it.
            norm: The fused decoder's RMS norms: ``model`` (the model's own formula in its order of roundings),
                ``torch`` (``F.rms_norm``: one kernel on a CUDA GPU, rounding once where the model rounds twice),
                or ``auto`` (``torch`` where the decoder computes in 16 bits on a CUDA GPU, else ``model``: where the
                row GEMM multiplies, one compiled call, :mod:`rlflow.rollout.decode_ops`, summing in its own order).
            cuda_graphs: On a CUDA GPU, replay the fused decoder's decode steps as CUDA graphs, one per stretch
                between two attention calls (:mod:`rlflow.rollout.graphs`); a capture that fails is logged once and
                the run decodes eagerly. Ignored on a CPU and without the fused decoder.
            split_stragglers: Move the rows still decoding in a group of ``n >= 4`` with at most ``n // 4`` of them
                left into groups of one, so that the group's finished rows stop costing decode steps
                (:meth:`ServeCall.split_stragglers <rlflow.rollout.serving.ServeCall.split_stragglers>`; not
                inside :meth:`keep_caches`). What a row samples does not change (its draws are its own); its
                arithmetic does, by rounding.
            attention: The decode cache's layout: ``groups`` (one per group, its prompt read once, each query also
                meeting its group's other rows' tokens, masked) or ``rows`` (one per row, the prompt copied to each),
                faster over completions long next to their prompts (docs/performance.md); ``groups`` inside
                :meth:`keep_caches`. What a row samples does not change; its arithmetic does, by rounding.
        """
        if max_batch_size < 1 or prefill_batch_size < 1:
            raise ValueError("engine max_batch_size and prefill_batch_size must be >= 1")
        self.max_batch_size = max_batch_size
        self.prefill_batch_size = prefill_batch_size
        self.seed = seed
        self.fused = fused
        self.min_shared_prefix = min_shared_prefix
        self.calls = 0  # seeded calls so far: with the seed, the whole random state (rng_state)
        if dtype not in DECODE_DTYPES:
            raise ValueError(f"engine dtype must be one of {', '.join(DECODE_DTYPES)}; got {dtype!r}")
        self.dtype = dtype
        torch_norm_for(norm, torch.float32, torch.device("cpu"))  # a bad value fails here, not at the first rollout
        self.norm = norm
        self.cuda_graphs = cuda_graphs
        self.split_stragglers = split_stragglers
        if attention not in ATTENTION_LAYOUTS:
            raise ValueError(f"engine attention must be one of {', '.join(ATTENTION_LAYOUTS)}; got {attention!r}")
        self.attention = attention
        self.split_rows = 0  # rows moved into groups of one (split_stragglers), over the engine's life
        self._graphed: GraphedDecoder | None = None  # the kept decoder's graphs (cuda_graphs, on a CUDA GPU)
        self.graphs_error: str | None = None  # why graph capture failed, once it has (the engine then runs eagerly)
        self._decoder: FusedDecoder | None = None  # the fused decoder of the rollout call in progress, if any
        self._kept_decoder: tuple[Any, FusedDecoder] | None = None  # (weights' key, decoder) reused across calls
        self._stale = False  # sync_weights since the kept decoder copied the weights
        self._checked_model: Any = None  # the model bind() last found supported (checked once per model)
        self.decode_path = ""  # how bind()'s probe decoded ("fused decode" or why not; graphs; a CPU's products)
        self.session: SessionCache | None = None  # rows' caches kept across calls (keep_caches), else None
        self.prefilled_tokens = 0  # tokens run through a prefill forward (counted over the engine's life)
        self.reused_tokens = 0  # prompt tokens taken from a kept cache instead (keep_caches)
        # Partial rollouts (rlflow.rollout.pipeline): ``step_hook(iteration)`` runs before every iteration of the
        # decode loop and returns True when it changed the model's weights (the rows keep their caches; the fused
        # decoder is rebuilt on the new weights); ``version`` set: each token is stamped with it
        # (Completion.token_versions).
        self.step_hook: Any = None
        self.version: int | None = None

    @contextmanager
    def keep_caches(self):
        """Within this block, keep each finished row's KV cache and continue a later prompt that extends a row's
        prompt and completion from that cache, prefilling only the new tokens (:mod:`rlflow.rollout.continuation`;
        the multi-turn loop opens one block per rollout call). The weights must not change inside the block."""
        self.session = SessionCache()
        try:
            yield self.session
        finally:
            self.session = None

    def bind(self, model: Any, tokenizer: Any) -> None:
        """Point the engine at ``model``; the first time for a model, check that the engine can run it.

        Raises :class:`~rlflow.rollout.base.UnsupportedModelError` naming what the engine does not implement
        (:func:`~rlflow.rollout.engine_support.static_unsupported_reason`) or how a two-prompt probe decode
        failed (:func:`~rlflow.rollout.engine_support.probe_error`).
        """
        super().bind(model, tokenizer)
        if model is not self._checked_model:
            reason = static_unsupported_reason(model) or probe_error(self, model)
            if reason:
                raise UnsupportedModelError("engine", reason)
            self._checked_model = model
            if self._graphed is not None:  # the probe decoded through graphs (cuda_graphs, on a CUDA GPU)
                self.decode_path += ", decode steps as CUDA graphs"
            elif self.graphs_error:
                self.decode_path += f", eager decode steps (CUDA graph capture failed: {self.graphs_error})"
            decoder = self._kept_decoder[1] if self._kept_decoder is not None else None
            if decoder is not None and decoder.embed.device.type == "cpu" and decoder.large_enough_to_pack():
                products = products_in_words(decode_dtype(self.dtype, decoder.embed.device) or decoder.dtype)
                self.decode_path += f", {products}" if products else ""

    def sync_weights(self) -> None:
        """The weights changed: the next rollout copies them again. The fused decoder's copies are dropped now,
        unless CUDA graphs were captured over them: then the next rollout copies the new weights into them.

        Whoever changes the weights must call it (the trainer after every optimizer step, pipelined or not; the
        generator process before every job): the kept decoder's key cannot see every change, since a fused
        optimizer kernel (``torch.optim.AdamW(fused=True)``) updates the parameters in place without moving their
        version counters."""
        self._stale = True
        if self._graphed is None:
            self._kept_decoder = None

    def _fused_decoder(self, model: Any, device: torch.device) -> FusedDecoder | None:
        """The fused decoder of ``model`` (None where it cannot run): the one of the last call while the weights
        are unchanged (same storage, same in-place version counters, same LoRA switches, no :meth:`sync_weights`
        since); where its steps run as CUDA graphs and only the weights' values changed, the same one with the new
        weights copied in (:meth:`FusedDecoder.refresh`: the graphs stay); else a new one (its weight copies, in
        the ``dtype`` option's precision, are what a rollout call decodes with)."""
        if not self.fused or FusedDecoder.unsupported_reason(model) is not None:
            return None
        dtype = decode_dtype(self.dtype, device)
        adapters = tuple((m.disable_adapters, m.merged, tuple(m.active_adapters))  # PEFT LoRA layers' switches
                         for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "merged"))
        key = (id(model), dtype, adapters, tuple((p.data_ptr(), p._version) for p in model.parameters()))
        kept = self._kept_decoder
        if kept is not None and kept[0] == key and not self._stale:
            return kept[1]
        if kept is not None and self._graphed is not None and self._graphed.decoder is kept[1] and \
                kept[0][:3] == key[:3] and [p for p, _ in kept[0][3]] == [p for p, _ in key[3]]:
            kept[1].refresh(model)  # the same weights' new values, into the copies the graphs read
        else:
            self._kept_decoder = self._graphed = None  # free the old copies (and their graphs) before new ones
            # packed before any product where packed products round unlike torch.mm: all packed alike
            kept = (key, FusedDecoder(model, dtype, self.norm, pack_rows=min(self.max_batch_size, 16)))
        self._kept_decoder, self._stale = (key, kept[1]), False
        return kept[1]

    @property
    def pad_id(self) -> int:
        tok = self.tokenizer
        pid = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return int(pid) if pid is not None else 0

    def _prefill_head(self, head: list[int], device: torch.device):
        """Run the prompt head common to every prompt once; return its per-layer keys and values ``[kv, len, d]``."""
        self.prefilled_tokens += len(head)
        if self._decoder is not None:
            keys, values, _, _ = self._prefill_fused([head], device, None)
            return [k[0] for k in keys], [v[0] for v in values]
        cache = DynamicCache(config=self.model.config)
        self.model(
            input_ids=torch.tensor([head], device=device), use_cache=True, logits_to_keep=1,
            **cache_kwargs(self.model, cache),
        )
        return [layer.keys[0] for layer in cache.layers], [layer.values[0] for layer in cache.layers]

    def _prefill(self, prompts: list[list[int]], device: torch.device, head=None):
        """One forward pass over distinct ``prompts``; return per-layer keys, values, their 2D mask and last logits.

        With ``head`` (``(keys, values)`` of :meth:`_prefill_head` for the first ``head_len`` tokens, which every
        prompt starts with), only the rest of each prompt is run, attending to the head's cache, and only the
        rest's keys/values are returned. Through the fused decoder (the rollout call's, when it has one) prompts
        are right-padded; through the model's forward they are left-padded with position ids counting real
        tokens only. Either way the mask marks the real tokens and the decode attention ignores the rest.
        """
        if self._decoder is not None:
            return self._prefill_fused(prompts, device, head)
        head_len = 0 if head is None else head[0][0].shape[1]
        cache = DynamicCache(config=self.model.config)
        if head_len:
            for layer, (k, v) in enumerate(zip(*head)):
                cache.update(k.expand(len(prompts), -1, -1, -1), v.expand(len(prompts), -1, -1, -1), layer)
        rests = [p[head_len:] for p in prompts]
        width = max(len(r) for r in rests)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), head_len + width), dtype=torch.long)
        mask[:, :head_len] = 1
        for i, r in enumerate(rests):
            ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            mask[i, head_len + width - len(r):] = 1
        position_ids = (mask.cumsum(1) - 1).clamp(min=0)[:, head_len:]
        out = self.model(
            input_ids=ids.to(device), attention_mask=mask.to(device), position_ids=position_ids.to(device),
            use_cache=True, logits_to_keep=1, **cache_kwargs(self.model, cache),
        )
        keys = [layer.keys[:, :, head_len:] for layer in cache.layers]
        values = [layer.values[:, :, head_len:] for layer in cache.layers]
        return keys, values, mask[:, head_len:].to(device), out.logits[:, -1]

    def _admit(self, prompts: list[list[int]], hits: list, device: torch.device, head=None):
        """:meth:`_prefill` of ``prompts``; those with a kept cache (``hits[i]``, taken out of the session) are
        prefilled on top of it (only their new tokens), the others (``hits[i]`` None) from scratch."""
        fresh = [j for j, hit in enumerate(hits) if hit is None]
        cont = [j for j, hit in enumerate(hits) if hit is not None]
        parts = []
        if fresh:
            head_len = 0 if head is None else head[0][0].shape[1]
            self.prefilled_tokens += sum(len(prompts[j]) - head_len for j in fresh)
            parts.append((fresh, self._prefill([prompts[j] for j in fresh], device, head)))
        if cont:
            self.reused_tokens += sum(hits[j][0] for j in cont)
            self.prefilled_tokens += sum(len(prompts[j]) - hits[j][0] for j in cont)
            parts.append((cont, prefill_on_caches(self, [prompts[j] for j in cont], [hits[j] for j in cont], device)))
        return merge_prefills(parts, len(prompts))

    def _prefill_fused(self, prompts: list[list[int]], device: torch.device, head=None):
        """:meth:`_prefill` through the fused decoder: the right-padded rests of all prompts as one flat batch of
        tokens, causal attention (over the head's keys too) in ``scaled_dot_product_attention``."""
        decoder = self._decoder
        head_len = 0 if head is None else head[0][0].shape[1]
        rests = [p[head_len:] for p in prompts]
        batch, width = len(rests), max(len(r) for r in rests)
        heads, kv_heads, dim = decoder.num_heads, decoder.num_kv_heads, decoder.head_dim
        ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        for i, r in enumerate(rests):
            ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        lengths = torch.tensor([len(r) for r in rests])
        cols = torch.arange(width)
        real = cols[None, :] < lengths[:, None]  # [batch, width]
        allowed = torch.ones((batch, 1, width, head_len + width), dtype=torch.bool)  # the head: always
        allowed[..., head_len:] = (cols[None, :] <= cols[:, None]) & real[:, None, None, :]  # causal, real keys
        positions = (head_len + cols).repeat(batch)
        ids, real, allowed, positions, lengths = (t.to(device) for t in (ids, real, allowed, positions, lengths))
        keys, values = [], []

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
            q = q.view(batch, width, heads, dim).transpose(1, 2)
            k = k.view(batch, width, kv_heads, dim).transpose(1, 2).contiguous()
            v = v.view(batch, width, kv_heads, dim).transpose(1, 2).contiguous()
            keys.append(k)
            values.append(v)
            if head_len:
                k = torch.cat([head[0][layer].expand(batch, -1, -1, -1), k], dim=2)
                v = torch.cat([head[1][layer].expand(batch, -1, -1, -1), v], dim=2)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, scale=scaling, enable_gqa=heads != kv_heads
            )
            return out.transpose(1, 2).reshape(batch * width, heads * dim)

        last = torch.arange(batch, device=device) * width + lengths - 1
        logits = decoder.step(ids.view(-1), positions, attend, select=last)
        return keys, values, real.long(), logits

    def _decode_step(self, state: DecodeState, pending: torch.Tensor, pos: torch.Tensor,
                     decoder: FusedDecoder | None = None) -> torch.Tensor:
        state.begin_step()
        if decoder is not None:
            decoder.prepack(pending.shape[0])  # the large matrices in the CPU GEMM's layout, once
            def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
                return state.write_attend(layer, q, k, v, scaling, compiled=decoder.compiled_ops)

            logits = self._fused_step(decoder, pending, pos, attend)
        else:
            config = self.model.config
            previous = config._attn_implementation
            config._attn_implementation = ATTENTION_NAME
            try:
                logits = self.model(
                    input_ids=pending[:, None], position_ids=pos[:, None], attention_mask=None,
                    rlflow_decode_state=state, use_cache=True, **cache_kwargs(self.model, state),
                ).logits[:, -1]
            finally:
                config._attn_implementation = previous
        state.end_step()
        return logits

    def _fused_step(self, decoder: FusedDecoder, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """``decoder.step`` through CUDA graphs where they apply (``cuda_graphs``, :mod:`rlflow.rollout.graphs`),
        else as it is; the first failed capture turns graphs off for the engine's life, with its reason logged."""
        kind = capture_kind(tokens.device) if self.cuda_graphs and self.graphs_error is None else None
        if kind is None:
            return decoder.step(tokens, positions, attend)
        if self._graphed is None or self._graphed.decoder is not decoder:
            self._graphed = None  # the old decoder's graphs go before new ones are captured
            self._graphed = GraphedDecoder(decoder, self.max_batch_size, kind)
        try:
            return self._graphed.step(tokens, positions, attend)
        except GraphCaptureError as error:
            self.graphs_error, self._graphed = str(error), None
            warn(f"engine: CUDA graph capture failed, decode steps run eagerly from now on ({error})")
            return decoder.step(tokens, positions, attend)

    def stream(self, prompts: list[list[int]], params: SamplingParams, n: int = 1,
               progress: Progress | None = None) -> Iterator[tuple[int, list[Completion]]]:
        """Yield ``(prompt_index, its n completions)`` as each group finishes (in finishing order); ``progress``
        is called per finished group. Sample ``s`` of prompt ``i`` draws from the stream ``(call key, i, s)``
        (:meth:`next_call_key`)."""
        check_call(prompts, n)
        yield from self.serve_call(prompts, 0 if params.greedy else self.next_call_key(), params, n, progress)

    def serve_call(self, prompts: list[list[int]], key: int, params: SamplingParams, n: int = 1,
                   progress: Progress | None = None, first: int = 0) -> Iterator[tuple[int, list[Completion]]]:
        """:meth:`stream` with the call key given: ``prompts`` are prompts ``first, first + 1, ...`` of the call
        of key ``key`` (:func:`~rlflow.rollout.draws.keyed_requests`), so a share of a call decoded here samples
        what the whole call would (:mod:`rlflow.rollout.split`); yields ``(index in prompts, group)``."""
        for request, group in self.serve(ListSource(keyed_requests(prompts, key, n, first)), params, progress):
            yield request.tag, group

    def serve(self, source: RequestSource, params: SamplingParams,
              progress: Progress | None = None) -> Iterator[tuple[DecodeRequest, list[Completion]]]:
        """Decode the requests ``source`` hands over, admitting each as soon as there is room (also while others
        decode); yield ``(request, its completions)`` as each request's rows finish. Between steps the source is
        polled without blocking; only when nothing is left to decode does the loop wait on it, and it ends when the
        source says no request will come (:mod:`rlflow.rollout.requests`).

        Requests are prefilled in batches of ``prefill_batch_size`` (on top of their kept caches inside
        :meth:`keep_caches`) and decoded in lanes by group size (:class:`~rlflow.rollout.decode_state.LaneStates`);
        the prefix common to the first requests is prefilled once when none of them continues a kept cache, and
        later requests that start with it share it too. The loop's steps are
        :class:`~rlflow.rollout.serving.ServeCall`'s. It runs in inference mode
        (:func:`~rlflow.rollout.hardware.inference_context`: ``no_grad`` under gloo or FSDP), entered on every
        resume of the generator and left at every ``yield``, so the caller's code between two groups runs in its
        own mode."""
        return inference_context(self.model)(self._serve)(source, params, progress)

    def _serve(self, source: RequestSource, params: SamplingParams,
               progress: Progress | None = None) -> Iterator[tuple[DecodeRequest, list[Completion]]]:
        """:meth:`serve` outside the inference context: the model in eval mode and the call's fused decoder set
        while :class:`~rlflow.rollout.serving.ServeCall` runs, both put back when it ends or is closed."""
        model = self.model
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        self._decoder = self._fused_decoder(model, device)
        call = ServeCall(self, params, device, progress)
        try:
            yield from call.run(source)
        finally:
            self._decoder = None
            model.train(was_training)

    def _share_head(self, requests: list[DecodeRequest], hits: list, device: torch.device):
        """``(head ids, head keys/values)`` of the prefix common to a call's first ``requests``, prefilled once
        (:meth:`_prefill_head`), when it is at least ``min_shared_prefix`` long and none of them continues a kept
        cache (``hits``); else None."""
        head_len = common_prefix_len([r.ids for r in requests]) if len(requests) > 1 else 0
        if all(h is None for h in hits) and self.min_shared_prefix and head_len >= self.min_shared_prefix:
            head_ids = requests[0].ids[:head_len]
            return head_ids, self._prefill_head(head_ids, device)
        return None

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1,
                 progress: Progress | None = None) -> list[list[Completion]]:
        """``n`` completions per prompt in prompt order; ``progress(completions, tokens)`` is called per finished
        group."""
        return in_prompt_order(self.stream(prompts, params, n, progress=progress), len(prompts))
