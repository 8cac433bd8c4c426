"""The ``engine`` rollout backend: a decode loop of its own over the live transformers policy.

Why not ``model.generate``: GRPO samples ``n`` completions of every prompt, and ``generate`` prefills each of
the ``n`` copies separately, stores ``n`` copies of the prompt's keys and values and reads all of them on
every token, keeps finished rows in the batch until the longest one ends, and pays its general machinery
(logits processors, stopping criteria, mask building) on every token. This engine

* prefills each *distinct* prompt once and keeps one copy of its keys/values for its whole group: decode-time
  attention is split into a *shared prefix* part (the ``n`` completions' queries of a group multiply the
  group's prompt keys in one matrix product, so the prompt cache is read once per group, not once per
  completion; "cascade attention") and a per-sequence *suffix* part over the generated tokens, joined in one
  softmax;
* runs continuous batching: a finished sequence leaves the batch at the step it ends, a group's prompt cache
  is freed when its last sequence ends, and waiting prompts are prefilled and join the running batch as soon
  as there is room (``max_batch_size`` sequences);
* prefills the token prefix common to every prompt of the rollout (system prompt, instruction, chat-template
  head) once, keeps one copy of its keys/values, and attends to it with one matrix product for all rows;
* decodes with its own forward of the live weights (:mod:`rlflow.rollout.fused`: q/k/v and gate/up folded into
  one matrix product each, no per-token module, hook, cache-object or mask machinery) for Qwen2/Qwen3/Llama-style
  models, and otherwise hands the model's forward its own attention function and state;
* samples with temperature / top-k / top-p and returns ``log_softmax(logits / temperature)`` of each taken token
  (before truncation, as :class:`~rlflow.rollout.base.Completion` specifies), stopping exactly at the first stop
  token (kept) or at ``max_tokens``;
* yields each prompt's group as soon as its last completion finishes (:meth:`EngineRollout.stream`), so
  judging can overlap with the rest of the generation.

Simplifications: the prompt caches of a batch are right-padded to the longest prompt and the generated-token
caches are contiguous per sequence and grow by doubling up to ``max_tokens`` (masked, exact, but not a paged
block table); only the prefix common to *all* prompts of a call is shared across groups (no radix tree). The
prefill uses the model's own attention implementation. Decoding through the model's forward (architectures the fused
path does not cover) needs attention modules that call ``past_key_values.update(k, v, layer_idx)`` and take the
layer's mask from a ``{"full_attention": ...}`` mapping; sliding-window and hybrid linear-attention models are
refused.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache

from rlflow.rollout.base import Completion, RolloutBackend, SamplingParams
from rlflow.rollout.fused import FusedDecoder

ATTENTION_NAME = "rlflow_shared_prefix"


@dataclass
class _Row:
    """A sequence being decoded: its prompt, its index in the group and what it has sampled so far."""

    prompt: int
    sample: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    alive: bool = True


class DecodeState:
    """The KV cache of a decode batch: one prompt cache per group and one generated-token cache per sequence.

    It stands in for transformers' ``Cache`` during decode steps (the model calls :meth:`update`) and is passed
    as the attention mask, so :func:`shared_prefix_attention` finds everything it needs in one object.

    Layout, per layer: ``prefix_k/v[layer]`` ``[groups, kv_heads, prompt_width, head_dim]`` hold each group's
    prompt: the rollout-wide head (``head``, keys/values ``[kv_heads, head_len, head_dim]`` per layer, prefilled
    once and copied in front of each group's own tokens when the group joins, so that decoding reads one prompt
    cache per group) and then the group's left-padded rest; ``prefix_bias`` ``[groups, prompt_width]`` is 0 on
    real tokens and -inf on padding. ``suffix_k/v[layer]`` ``[rows, kv_heads, capacity, head_dim]`` hold each
    row's generated tokens (``capacity`` doubles up to ``max_tokens`` as needed); ``row_group``/``row_slot``
    place each row in its group.

    While every row has fed the same number of tokens (``fed``; the rows admitted together, the usual case)
    a step writes one column of the generated-token caches with a slice copy and needs no mask. Rows that join
    later switch the state to per-row lengths (``suffix_len``) and a mask per step; compaction that leaves
    rows of one length switches back.
    """

    def __init__(self, n: int, max_tokens: int, head: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None) -> None:
        self.n = n
        self.head_k, self.head_v = head if head is not None else (None, None)
        self.max_tokens = max_tokens
        self.capacity = min(max_tokens, 32)  # generated-token slots per row; grows (doubling) up to max_tokens
        self.prefix_k: list[torch.Tensor] = []
        self.prefix_v: list[torch.Tensor] = []
        self.prefix_bias: torch.Tensor | None = None
        self.prefix_padded = False  # whether any prompt cache has padding (else prefix_bias is all zeros)
        self.suffix_k: list[torch.Tensor] = []
        self.suffix_v: list[torch.Tensor] = []
        self.fed: int | None = 0  # tokens fed by every row when all rows agree (uniform mode), else None
        self.suffix_len: torch.Tensor | None = None  # per-row tokens fed (per-row mode only)
        self.row_group: torch.Tensor | None = None
        self.row_slot: torch.Tensor | None = None
        self.alive: torch.Tensor | None = None  # finished rows stay (masked out of the bookkeeping) until compaction
        self.group_prompt: list[int] = []  # prompt index of each group
        self.step_bias: torch.Tensor | None = None
        self.step_width = 0

    @property
    def num_rows(self) -> int:
        return 0 if self.row_group is None else int(self.row_group.shape[0])

    # -------------------------------------------------------------------- transformers' cache protocol
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the step's key/value (``[rows, kv_heads, 1, dim]``) at each row's next free suffix slot."""
        self.write(layer_idx, key_states[:, :, 0], value_states[:, :, 0])
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self.prefix_bias is None:
            return 0
        fed = self.fed if self.fed is not None else int(self.suffix_len.max())
        return fed + self.prefix_bias.shape[1]

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the step's ``key``/``value`` (``[rows, kv_heads, dim]``) in each row's next generated-token slot."""
        if self.fed is not None:
            self.suffix_k[layer][:, :, self.fed] = key
            self.suffix_v[layer][:, :, self.fed] = value
        else:
            rows = torch.arange(key.shape[0], device=key.device)
            self.suffix_k[layer][rows, :, self.suffix_len] = key
            self.suffix_v[layer][rows, :, self.suffix_len] = value

    # ------------------------------------------------------------------------------- batch bookkeeping
    def add_groups(self, prompt_ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor) -> None:
        """Add prefilled groups: per-layer ``[groups, kv_heads, width, dim]`` caches (of the prompts after the
        rollout-wide head, if any) and their 2D ``mask``."""
        g_new, n = len(prompt_ids), self.n
        if self.head_k is not None:  # the head's keys/values in front of every group's own
            keys = [torch.cat([h.expand(g_new, -1, -1, -1), k], dim=2) for h, k in zip(self.head_k, keys)]
            values = [torch.cat([h.expand(g_new, -1, -1, -1), v], dim=2) for h, v in zip(self.head_v, values)]
            mask = torch.cat([mask.new_ones((g_new, self.head_k[0].shape[1])), mask], dim=1)
        bias = torch.zeros(mask.shape, dtype=keys[0].dtype, device=keys[0].device).masked_fill(mask == 0, float("-inf"))
        g_old = len(self.group_prompt)
        rows_new = g_new * n
        kv_shape = (rows_new, keys[0].shape[1], self.capacity, keys[0].shape[3])
        device = bias.device
        if self.prefix_bias is None:
            self.prefix_k, self.prefix_v, self.prefix_bias = list(keys), list(values), bias
            self.suffix_k = [keys[0].new_zeros(kv_shape) for _ in keys]
            self.suffix_v = [keys[0].new_zeros(kv_shape) for _ in keys]
            self.alive = torch.ones(rows_new, dtype=torch.bool, device=device)
            self.row_group = torch.zeros(0, dtype=torch.long, device=device)
            self.row_slot = torch.zeros(0, dtype=torch.long, device=device)
            self.fed, self.suffix_len = 0, None
        else:
            width = max(self.prefix_bias.shape[1], bias.shape[1])

            def pad(t: torch.Tensor, value: float = 0.0) -> torch.Tensor:
                extra = width - t.shape[-2 if t.dim() == 4 else -1]
                if extra == 0:
                    return t
                return torch.nn.functional.pad(t, (0, 0, 0, extra) if t.dim() == 4 else (0, extra), value=value)

            self.prefix_k = [torch.cat([pad(a), pad(b)]) for a, b in zip(self.prefix_k, keys)]
            self.prefix_v = [torch.cat([pad(a), pad(b)]) for a, b in zip(self.prefix_v, values)]
            self.prefix_bias = torch.cat([pad(self.prefix_bias, float("-inf")), pad(bias, float("-inf"))])
            self.suffix_k = [torch.cat([s, s.new_zeros(kv_shape)]) for s in self.suffix_k]
            self.suffix_v = [torch.cat([s, s.new_zeros(kv_shape)]) for s in self.suffix_v]
            self.alive = torch.cat([self.alive, self.alive.new_ones(rows_new)])
            if self.fed != 0:  # the new rows start behind the running ones: per-row lengths from now on
                old = self.suffix_len if self.fed is None else torch.full((self.num_rows,), self.fed, device=device)
                self.suffix_len, self.fed = torch.cat([old, old.new_zeros(rows_new)]), None
        groups = torch.arange(g_old, g_old + g_new, device=device).repeat_interleave(n)
        slots = torch.arange(n, device=device).repeat(g_new)
        self.row_group = torch.cat([self.row_group, groups])
        self.row_slot = torch.cat([self.row_slot, slots])
        self.group_prompt.extend(prompt_ids)
        self.prefix_padded = bool(torch.isinf(self.prefix_bias).any())

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Keep rows ``keep`` (in order); free the prompt caches of groups with no row left."""
        self.suffix_k = [s[keep] for s in self.suffix_k]
        self.suffix_v = [s[keep] for s in self.suffix_v]
        if self.fed is None:
            self.suffix_len = self.suffix_len[keep]
            if self.suffix_len.numel() and int(self.suffix_len.min()) == int(self.suffix_len.max()):
                self.fed, self.suffix_len = int(self.suffix_len[0]), None  # one length again: uniform mode
        self.alive = self.alive[keep]
        row_group = self.row_group[keep]
        self.row_slot = self.row_slot[keep]
        live = torch.unique(row_group)
        if live.numel() < len(self.group_prompt):
            remap = torch.full((len(self.group_prompt),), -1, dtype=torch.long, device=live.device)
            remap[live] = torch.arange(live.numel(), device=live.device)
            row_group = remap[row_group]
            self.prefix_k = [p[live] for p in self.prefix_k]
            self.prefix_v = [p[live] for p in self.prefix_v]
            bias = self.prefix_bias[live]
            real = torch.isfinite(bias).any(dim=0).nonzero()
            width = int(real[-1]) + 1 if real.numel() else bias.shape[1]
            self.prefix_bias = bias[:, :width]
            self.prefix_k = [p[:, :, :width] for p in self.prefix_k]
            self.prefix_v = [p[:, :, :width] for p in self.prefix_v]
            self.group_prompt = [self.group_prompt[g] for g in live.tolist()]
            self.prefix_padded = bool(torch.isinf(self.prefix_bias).any())
        self.row_group = row_group

    def begin_step(self) -> None:
        """Size the step's view of the generated-token caches (the rows' cached tokens plus the one fed now) and,
        with per-row lengths, its mask."""
        self.step_width = (self.fed if self.fed is not None else int(self.suffix_len.max())) + 1
        if self.step_width > self.capacity:  # grow the generated-token caches (zero-filled: masked, but finite)
            grow = min(self.max_tokens, max(self.step_width, 2 * self.capacity)) - self.capacity
            self.suffix_k = [torch.nn.functional.pad(t, (0, 0, 0, grow)) for t in self.suffix_k]
            self.suffix_v = [torch.nn.functional.pad(t, (0, 0, 0, grow)) for t in self.suffix_v]
            self.capacity += grow
        if self.fed is not None:  # every row sees all step_width slots: no mask
            self.step_bias = None
            return
        cols = torch.arange(self.step_width, device=self.suffix_len.device)
        allowed = cols[None, :] <= self.suffix_len[:, None]
        dtype = self.prefix_bias.dtype
        self.step_bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))

    def end_step(self) -> None:
        if self.fed is not None:
            self.fed += 1  # finished rows advance too: they write only their own slots, which nobody else reads
        else:
            self.suffix_len = self.suffix_len + self.alive.long()  # a finished row rewrites its last slot

    def to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """``[rows, ...]`` -> ``[groups, n, ...]`` (a view while every group is whole and in order, else a scatter)."""
        groups = len(self.group_prompt)
        if x.shape[0] == groups * self.n:
            return x.view((groups, self.n) + x.shape[1:])
        grid = x.new_zeros((groups, self.n) + x.shape[1:])
        grid[self.row_group, self.row_slot] = x
        return grid


def shared_prefix_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Any, scaling: float | None = None, **kwargs: Any):
    """Decode-step attention over a group's shared prompt cache plus each row's own generated tokens.

    ``query`` is ``[rows, heads, 1, dim]``; ``attention_mask`` is the :class:`DecodeState`. Returns
    ``([rows, 1, heads, dim], None)`` as transformers' attention functions do.
    """
    return attend_cached(attention_mask, module.layer_idx, query, scaling), None


def attend_cached(state: DecodeState, layer: int, query: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
    """The maths of :func:`shared_prefix_attention`: ``query`` ``[rows, heads, 1, dim]`` -> ``[rows, 1, heads, dim]``.

    Two score blocks joined in one softmax: the ``n * rep`` queries of a group (``rep`` query heads per key/value
    head) against the group's one prompt cache in one matrix product per group, and each row's queries against
    its own generated tokens. Scores are laid out ``[groups, n, kv, rep, ...]`` so that joining them is one copy.
    """
    rows, heads, _, dim = query.shape
    pk, pv = state.prefix_k[layer], state.prefix_v[layer]
    groups, kv_heads, width, _ = pk.shape
    rep, n = heads // kv_heads, state.n
    scale = dim ** -0.5 if scaling is None else scaling
    cast = pk.dtype != torch.float32  # attention in float32; no-op casts skipped on the hot path
    q = query.reshape(rows, kv_heads, rep, dim)
    q = q.float() if query.dtype != torch.float32 else q
    if scale != 1.0:
        q = q * scale
    dense = rows == groups * n  # every group whole and in order: the grid is a view of the rows
    # prompt: each group's n * rep queries against its one prompt cache
    q_grid = state.to_grid(q).transpose(1, 2).reshape(groups, kv_heads, n * rep, dim)
    s_pre = torch.matmul(q_grid, (pk.float() if cast else pk).transpose(-1, -2))
    if state.prefix_padded:
        s_pre.add_(state.prefix_bias.float()[:, None, None, :])
    s_pre = s_pre.view(groups, kv_heads, n, rep, width).transpose(1, 2)  # [groups, n, kv, rep, width]
    # generated tokens: each row against its own
    sk = state.suffix_k[layer][:, :, : state.step_width]
    sv = state.suffix_v[layer][:, :, : state.step_width]
    if cast:
        pv, sk, sv = pv.float(), sk.float(), sv.float()
    s_suf = torch.matmul(q, sk.transpose(-1, -2))  # [rows, kv, rep, step_width]
    if state.step_bias is not None:
        s_suf.add_(state.step_bias.float()[:, None, None, :])
    if dense:
        scores = torch.cat([s_pre, s_suf.view(groups, n, kv_heads, rep, -1)], dim=-1).view(rows, kv_heads, rep, -1)
    else:
        scores = torch.cat([s_pre[state.row_group, state.row_slot], s_suf], dim=-1)
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs[..., width:], sv)  # [rows, kv, rep, dim]
    p_grid = state.to_grid(probs[..., :width]).transpose(1, 2).reshape(groups, kv_heads, n * rep, width)
    o_pre = torch.matmul(p_grid, pv).view(groups, kv_heads, n, rep, dim).transpose(1, 2)
    if dense:
        out = out.view(groups, n, kv_heads, rep, dim).add_(o_pre)
    else:
        out = out.add_(o_pre[state.row_group, state.row_slot])
    return out.reshape(rows, 1, heads, dim).to(query.dtype)


AttentionInterface.register(ATTENTION_NAME, shared_prefix_attention)


def common_prefix_len(prompts: list[list[int]]) -> int:
    """Length of the token prefix shared by every prompt, leaving at least one own token per prompt."""
    first, n = prompts[0], min(len(p) for p in prompts) - 1
    for other in prompts[1:]:
        n = next((i for i in range(n) if other[i] != first[i]), n)
    return n


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` (``[rows, vocab]``); return ``(tokens, logprobs)``.

    The log-probs are ``log_softmax(logits / temperature)`` of the taken tokens (temperature 1 when greedy),
    before top-k/top-p truncation; sampling itself draws from the truncated, renormalised distribution
    (top-k keeps ties with the k-th value; top-p keeps the smallest set of best tokens whose mass reaches
    ``top_p``, as transformers' warpers do).
    """
    logits = logits.float()
    temperature = params.temperature if not params.greedy else 1.0
    logp = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
    if params.greedy:
        tokens = logits.argmax(dim=-1)
    else:
        filtered = logp
        if params.top_k and params.top_k < filtered.shape[-1]:
            kth = torch.topk(filtered, params.top_k, dim=-1).values[:, -1:]
            filtered = filtered.masked_fill(filtered < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_lp, order = torch.sort(filtered, dim=-1, descending=True)
            probs = sorted_lp.softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass of the strictly better tokens
            drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= params.top_p)
            filtered = filtered.masked_fill(drop, float("-inf"))
        # inverse-CDF sampling: one uniform per row (multinomial draws one exponential per vocabulary entry);
        # the CDF in float64 so that the tail of a large vocabulary keeps its mass. u is in (0, total], and the
        # first index whose CDF reaches u always has positive mass (a token of zero mass repeats the CDF before it)
        cdf = filtered.exp().double().cumsum(dim=-1)
        u = (1.0 - torch.rand((cdf.shape[0], 1), generator=generator, device=cdf.device, dtype=torch.float64)) * cdf[:, -1:]
        tokens = torch.searchsorted(cdf, u).squeeze(-1)
    return tokens, logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class EngineRollout(RolloutBackend):
    """Rollout with a shared prompt cache per group and continuous batching on the live policy (faster than ``hf``)."""

    def __init__(self, max_batch_size: int = 256, prefill_batch_size: int = 16, seed: int | None = None,
                 fused: bool = True, min_shared_prefix: int = 16) -> None:
        """
        Args:
            max_batch_size: Most sequences decoded together (bounds the KV cache's memory); a prompt's ``n``
                completions always join together, so at least ``n`` run at once.
            prefill_batch_size: Most distinct prompts prefilled in one forward pass.
            seed: Seed of the engine's own random generator; None draws from torch's global generator.
            fused: Decode with rlflow's own forward of the live weights (:mod:`rlflow.rollout.fused`) where the
                architecture is supported (Qwen2/Qwen3/Llama, unsharded); otherwise, or when False, decode steps
                call the model's forward with the engine's attention function.
            min_shared_prefix: Prefill the token prefix common to all prompts of a rollout once, and attend to it
                with one matrix product for all rows, when it is at least this long (0 disables it).
        """
        if max_batch_size < 1 or prefill_batch_size < 1:
            raise ValueError("engine max_batch_size and prefill_batch_size must be >= 1")
        self.max_batch_size = max_batch_size
        self.prefill_batch_size = prefill_batch_size
        self.seed = seed
        self.fused = fused
        self.min_shared_prefix = min_shared_prefix
        self.generator: torch.Generator | None = None
        self._decoder: FusedDecoder | None = None  # the fused decoder of the rollout call in progress, if any

    def bind(self, model: Any, tokenizer: Any) -> None:
        super().bind(model, tokenizer)
        config = model.config
        types = set(getattr(config, "layer_types", None) or ["full_attention"])
        if types != {"full_attention"}:
            raise ValueError(
                f"the engine rollout backend supports full-attention decoders only; this model's layer types are "
                f"{sorted(types)}; use data.rollout=hf"
            )
        if self.seed is not None and self.generator is None:
            self.generator = torch.Generator(device=next(model.parameters()).device).manual_seed(self.seed)

    @property
    def pad_id(self) -> int:
        tok = self.tokenizer
        pid = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return int(pid) if pid is not None else 0

    def _prefill_head(self, head: list[int], device: torch.device):
        """Run the prompt head common to every prompt once; return its per-layer keys and values ``[kv, len, d]``."""
        if self._decoder is not None:
            keys, values, _, _ = self._prefill_fused([head], device, None)
            return [k[0] for k in keys], [v[0] for v in values]
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=torch.tensor([head], device=device), past_key_values=cache, use_cache=True, logits_to_keep=1)
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
            past_key_values=cache, use_cache=True, logits_to_keep=1,
        )
        keys = [layer.keys[:, :, head_len:] for layer in cache.layers]
        values = [layer.values[:, :, head_len:] for layer in cache.layers]
        return keys, values, mask[:, head_len:].to(device), out.logits[:, -1]

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
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling, enable_gqa=heads != kv_heads)
            return out.transpose(1, 2).reshape(batch * width, heads * dim)

        last = torch.arange(batch, device=device) * width + lengths - 1
        logits = decoder.step(ids.view(-1), positions, attend, select=last)
        return keys, values, real.long(), logits

    def _decode_step(self, state: DecodeState, pending: torch.Tensor, pos: torch.Tensor,
                     decoder: FusedDecoder | None = None) -> torch.Tensor:
        state.begin_step()
        if decoder is not None:
            def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
                state.write(layer, k[:, :, 0], v[:, :, 0])
                return attend_cached(state, layer, q, scaling).reshape(q.shape[0], -1)

            logits = decoder.step(pending, pos, attend)
        else:
            config = self.model.config
            previous = config._attn_implementation
            config._attn_implementation = ATTENTION_NAME
            try:
                logits = self.model(
                    input_ids=pending[:, None], position_ids=pos[:, None], attention_mask={"full_attention": state},
                    past_key_values=state, use_cache=True,
                ).logits[:, -1]
            finally:
                config._attn_implementation = previous
        state.end_step()
        return logits

    @torch.no_grad()
    def stream(self, prompts: list[list[int]], params: SamplingParams, n: int = 1) -> Iterator[tuple[int, list[Completion]]]:
        """Yield ``(prompt_index, its n completions)`` as each group finishes (in finishing order)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        model = self.model
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        stop_ids = set(params.stop_token_ids)
        stop_t = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
        capacity = max(self.max_batch_size, n)
        waiting = deque(range(len(prompts)))
        done: dict[int, list[tuple[int, Completion]]] = {}
        rows: list[_Row] = []
        decoder = FusedDecoder(model) if self.fused and FusedDecoder.unsupported_reason(model) is None else None
        self._decoder = decoder
        head_len = common_prefix_len(prompts) if len(prompts) > 1 else 0
        shared = self.min_shared_prefix and head_len >= self.min_shared_prefix
        head = self._prefill_head(prompts[0][:head_len], device) if shared else None
        state = DecodeState(n, params.max_tokens, head)
        pos = pending = None  # position of the token to feed, and that token, per row
        try:
            while waiting or rows:
                take = []
                while waiting and len(take) < self.prefill_batch_size and len(rows) + (len(take) + 1) * n <= capacity:
                    take.append(waiting.popleft())
                if take:  # admit waiting prompts: prefill once, sample each group's first tokens
                    keys, values, mask, logits = self._prefill([prompts[i] for i in take], device, head)
                    tokens, lps = sample_tokens(logits.repeat_interleave(n, dim=0), params, self.generator)
                    state.add_groups(take, keys, values, mask)
                    new_pos = torch.tensor([len(prompts[i]) for i in take], device=device).repeat_interleave(n)
                    pos = new_pos if pos is None else torch.cat([pos, new_pos])
                    pending = tokens if pending is None else torch.cat([pending, tokens])
                    offset = len(rows)
                    rows.extend(_Row(i, s) for i in take for s in range(n))
                    for i in take:
                        done[i] = []
                else:  # one decode step of every live row
                    tokens, lps = sample_tokens(self._decode_step(state, pending, pos, decoder), params, self.generator)
                    pos, pending, offset = pos + 1, tokens, 0
                finished = self._record(rows, offset, tokens, lps, stop_t, params.max_tokens)
                for j in finished:
                    row = rows[j]
                    row.alive = False
                    reason = "stop" if row.tokens[-1] in stop_ids else "length"
                    done[row.prompt].append((row.sample, Completion(row.tokens, row.logprobs, reason)))
                if finished:
                    state.alive[torch.tensor(sorted(finished), dtype=torch.long, device=device)] = False
                    for prompt in [p for p, group in done.items() if len(group) == n]:
                        yield prompt, [c for _, c in sorted(done.pop(prompt), key=lambda sc: sc[0])]
                # compact by whole groups (the rows of a group whose completions are all done): the batch stays
                # whole groups in order, so attention needs no scatter; and lazily, since dropping rows copies
                # the caches: when a quarter of the rows are done groups' or room is needed
                gone = sum(r.prompt not in done for r in rows)
                if gone and (4 * gone >= len(rows) or waiting):
                    keep_list = [j for j, r in enumerate(rows) if r.prompt in done]
                    rows = [rows[j] for j in keep_list]
                    if rows:
                        keep = torch.tensor(keep_list, dtype=torch.long, device=device)
                        state.keep_rows(keep)
                        pos, pending = pos[keep], pending[keep]
                    else:
                        state, pos, pending = DecodeState(n, params.max_tokens, head), None, None
        finally:
            self._decoder = None
            model.train(was_training)

    @staticmethod
    def _record(rows: list[_Row], offset: int, tokens: torch.Tensor, lps: torch.Tensor, stop_t: torch.Tensor,
                max_tokens: int) -> set[int]:
        """Append the sampled tokens to rows ``offset:``; return the indices of rows that just finished."""
        is_stop = torch.isin(tokens, stop_t).tolist() if stop_t.numel() else [False] * tokens.shape[0]
        finished = set()
        for j, (tok, lp, stop) in enumerate(zip(tokens.tolist(), lps.tolist(), is_stop)):
            row = rows[offset + j]
            if not row.alive:
                continue
            row.tokens.append(tok)
            row.logprobs.append(lp)
            if stop or len(row.tokens) >= max_tokens:
                finished.add(offset + j)
        return finished

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1, progress: Any = None) -> list[list[Completion]]:
        """``n`` completions per prompt in prompt order; ``progress(completions, tokens)`` is called per finished group."""
        groups: list[list[Completion] | None] = [None] * len(prompts)
        for i, group in self.stream(prompts, params, n):
            groups[i] = group
            if progress is not None:
                progress(len(group), sum(len(c.token_ids) for c in group))
        return groups  # type: ignore[return-value]
