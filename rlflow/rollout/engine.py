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

    Layout, per layer: ``prefix_k/v[layer]`` ``[groups, kv_heads, prompt_width, head_dim]`` (right-padded,
    ``prefix_bias`` ``[groups, prompt_width]`` is 0 on real tokens and -inf on padding), ``suffix_k/v[layer]``
    ``[rows, kv_heads, capacity, head_dim]`` (``capacity`` doubles up to ``max_tokens`` as needed) with
    ``suffix_len[row]`` tokens filled, ``row_group``/``row_slot`` place each row in its group.
    ``head_k/v[layer]`` ``[kv_heads, head_len, head_dim]`` (optional) hold the prompt head common to *every* prompt
    of the rollout (system prompt, instruction, chat-template head), stored once and attended by all rows in one
    matrix product; the group caches then hold only what follows it.
    """

    def __init__(self, n: int, max_tokens: int, head: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None) -> None:
        self.n = n
        self.head_k, self.head_v = head if head is not None else (None, None)
        self.max_tokens = max_tokens
        self.capacity = min(max_tokens, 32)  # generated-token slots per row; grows (doubling) up to max_tokens
        self.prefix_k: list[torch.Tensor] = []
        self.prefix_v: list[torch.Tensor] = []
        self.prefix_bias: torch.Tensor | None = None
        self.suffix_k: list[torch.Tensor] = []
        self.suffix_v: list[torch.Tensor] = []
        self.suffix_len: torch.Tensor | None = None
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
        rows = torch.arange(key_states.shape[0], device=key_states.device)
        self.suffix_k[layer_idx][rows, :, self.suffix_len] = key_states[:, :, 0]
        self.suffix_v[layer_idx][rows, :, self.suffix_len] = value_states[:, :, 0]
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self.suffix_len is None else int(self.suffix_len.max()) + (self.prefix_bias.shape[1] if self.prefix_bias is not None else 0)

    # ------------------------------------------------------------------------------- batch bookkeeping
    def add_groups(self, prompt_ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor) -> None:
        """Add prefilled groups: per-layer ``[groups, kv_heads, width, dim]`` caches and their 2D ``mask``."""
        bias = torch.zeros(mask.shape, dtype=keys[0].dtype, device=keys[0].device).masked_fill(mask == 0, float("-inf"))
        g_new, n = len(prompt_ids), self.n
        g_old = len(self.group_prompt)
        rows_new = g_new * n
        kv_shape = (rows_new, keys[0].shape[1], self.capacity, keys[0].shape[3])
        if self.prefix_bias is None:
            self.prefix_k, self.prefix_v, self.prefix_bias = list(keys), list(values), bias
            self.suffix_k = [keys[0].new_zeros(kv_shape) for _ in keys]
            self.suffix_v = [keys[0].new_zeros(kv_shape) for _ in keys]
            self.suffix_len = torch.zeros(rows_new, dtype=torch.long, device=bias.device)
            self.alive = torch.ones(rows_new, dtype=torch.bool, device=bias.device)
            self.row_group = torch.zeros(0, dtype=torch.long, device=bias.device)
            self.row_slot = torch.zeros(0, dtype=torch.long, device=bias.device)
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
            self.suffix_len = torch.cat([self.suffix_len, self.suffix_len.new_zeros(rows_new)])
            self.alive = torch.cat([self.alive, self.alive.new_ones(rows_new)])
        device = self.row_group.device
        groups = torch.arange(g_old, g_old + g_new, device=device).repeat_interleave(n)
        slots = torch.arange(n, device=device).repeat(g_new)
        self.row_group = torch.cat([self.row_group, groups])
        self.row_slot = torch.cat([self.row_slot, slots])
        self.group_prompt.extend(prompt_ids)

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Keep rows ``keep`` (in order); free the prompt caches of groups with no row left."""
        self.suffix_k = [s[keep] for s in self.suffix_k]
        self.suffix_v = [s[keep] for s in self.suffix_v]
        self.suffix_len = self.suffix_len[keep]
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
        self.row_group = row_group

    def begin_step(self) -> None:
        """Precompute the suffix mask of a decode step (the row's cached tokens plus the one fed now)."""
        self.step_width = int(self.suffix_len.max()) + 1
        if self.step_width > self.capacity:  # grow the generated-token caches (zero-filled: masked, but finite)
            grow = min(self.max_tokens, max(self.step_width, 2 * self.capacity)) - self.capacity
            self.suffix_k = [torch.nn.functional.pad(t, (0, 0, 0, grow)) for t in self.suffix_k]
            self.suffix_v = [torch.nn.functional.pad(t, (0, 0, 0, grow)) for t in self.suffix_v]
            self.capacity += grow
        cols = torch.arange(self.step_width, device=self.suffix_len.device)
        allowed = cols[None, :] <= self.suffix_len[:, None]
        dtype = self.prefix_bias.dtype
        self.step_bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))

    def end_step(self) -> None:
        self.suffix_len = self.suffix_len + self.alive.long()  # a finished row rewrites its last slot


def shared_prefix_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Any, scaling: float | None = None, **kwargs: Any):
    """Decode-step attention over a group's shared prompt cache plus each row's own generated tokens.

    ``query`` is ``[rows, heads, 1, dim]``; ``attention_mask`` is the :class:`DecodeState`. Returns
    ``([rows, 1, heads, dim], None)`` as transformers' attention functions do.
    """
    return attend_cached(attention_mask, module.layer_idx, query, scaling), None


def attend_cached(state: DecodeState, layer: int, query: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
    """The maths of :func:`shared_prefix_attention`: ``query`` ``[rows, heads, 1, dim]`` -> ``[rows, 1, heads, dim]``."""
    rows, heads, _, dim = query.shape
    pk, pv = state.prefix_k[layer], state.prefix_v[layer]
    groups, kv_heads, width, _ = pk.shape
    rep, n = heads // kv_heads, state.n
    scale = dim ** -0.5 if scaling is None else scaling
    q = query[:, :, 0].reshape(rows, kv_heads, rep, dim).float() * scale
    g_idx, s_idx = state.row_group, state.row_slot
    dense = rows == groups * n  # every group complete and in order (no row compacted out): reshapes, no scatter

    def to_groups(x: torch.Tensor) -> torch.Tensor:  # [rows, kv, rep, d] -> [groups, kv, n * rep, d]
        if not dense:
            grid = x.new_zeros((groups, n) + x.shape[1:])
            grid[g_idx, s_idx] = x
            x = grid
        return x.reshape(groups, n, kv_heads, rep, -1).permute(0, 2, 1, 3, 4).reshape(groups, kv_heads, n * rep, -1)

    def to_rows(x: torch.Tensor) -> torch.Tensor:  # [groups, kv, n * rep, d] -> [rows, kv, rep, d]
        x = x.view(groups, kv_heads, n, rep, -1).permute(0, 2, 1, 3, 4)
        return x.reshape(rows, kv_heads, rep, -1) if dense else x[g_idx, s_idx]

    # head: every row's queries together against the prompt head common to the whole rollout
    parts, head_len = [], 0
    if state.head_k is not None:
        hk, hv = state.head_k[layer], state.head_v[layer]  # [kv, head_len, d]
        head_len = hk.shape[1]
        q_all = q.permute(1, 0, 2, 3).reshape(kv_heads, rows * rep, dim)
        parts.append(torch.matmul(q_all, hk.float().transpose(-1, -2)).view(kv_heads, rows, rep, head_len).permute(1, 0, 2, 3))
    # prefix: the group's queries together against the group's one prompt cache
    s_pre = torch.matmul(to_groups(q), pk.float().transpose(-1, -2)) + state.prefix_bias.float()[:, None, None, :]
    parts.append(to_rows(s_pre))  # [rows, kv, rep, width]
    # suffix: each row against its own generated tokens
    sk = state.suffix_k[layer][:, :, : state.step_width]
    sv = state.suffix_v[layer][:, :, : state.step_width]
    s_suf = torch.matmul(q, sk.float().transpose(-1, -2)) + state.step_bias.float()[:, None, None, :]
    probs = torch.softmax(torch.cat([*parts, s_suf], dim=-1), dim=-1)
    p_pre, p_suf = probs[..., head_len: head_len + width], probs[..., head_len + width:]
    out = torch.matmul(p_suf, sv.float())  # [rows, kv, rep, dim]
    out = out + to_rows(torch.matmul(to_groups(p_pre), pv.float()))
    if head_len:
        p_head = probs[..., :head_len].permute(1, 0, 2, 3).reshape(kv_heads, rows * rep, head_len)
        out = out + torch.matmul(p_head, hv.float()).view(kv_heads, rows, rep, dim).permute(1, 0, 2, 3)
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
    logp = torch.log_softmax(logits / temperature, dim=-1)
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
        # the CDF in float64 so that the tail of a large vocabulary keeps its mass
        cdf = filtered.softmax(dim=-1).double().cumsum(dim=-1)
        u = torch.rand((cdf.shape[0], 1), generator=generator, device=cdf.device, dtype=torch.float64)
        total = cdf[:, -1:]
        u = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # strictly below the total
        tokens = torch.searchsorted(cdf, u, right=True).squeeze(-1)
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
        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=torch.tensor([head], device=device), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return [layer.keys[0] for layer in cache.layers], [layer.values[0] for layer in cache.layers]

    def _prefill(self, prompts: list[list[int]], device: torch.device, head=None):
        """One forward pass over distinct ``prompts``; return per-layer keys, values, their 2D mask and last logits.

        With ``head`` (``(keys, values)`` of :meth:`_prefill_head` for the first ``head_len`` tokens, which every
        prompt starts with), only the rest of each prompt is run, attending to the head's cache, and only the
        rest's keys/values are returned. Prompts are left-padded; position ids count real tokens only.
        """
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

    def _decode_step(self, state: DecodeState, pending: torch.Tensor, pos: torch.Tensor,
                     decoder: FusedDecoder | None = None) -> torch.Tensor:
        state.begin_step()
        if decoder is not None:
            def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
                state.update(k, v, layer)
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
        head_len = common_prefix_len(prompts) if len(prompts) > 1 else 0
        shared = self.min_shared_prefix and head_len >= self.min_shared_prefix
        head = self._prefill_head(prompts[0][:head_len], device) if shared else None
        state = DecodeState(n, params.max_tokens, head)
        decoder = FusedDecoder(model) if self.fused and FusedDecoder.unsupported_reason(model) is None else None
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
                dead = sum(not r.alive for r in rows)
                # compact lazily: dropping rows copies the caches, so do it when a quarter is dead or room is needed
                if dead and (4 * dead >= len(rows) or waiting):
                    keep_list = [j for j, r in enumerate(rows) if r.alive]
                    rows = [rows[j] for j in keep_list]
                    if rows:
                        keep = torch.tensor(keep_list, dtype=torch.long, device=device)
                        state.keep_rows(keep)
                        pos, pending = pos[keep], pending[keep]
                    else:
                        state, pos, pending = DecodeState(n, params.max_tokens, head), None, None
        finally:
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
