"""The engine's decode-time KV cache and its attention: one cache per GRPO group, read by one product per group.

:class:`DecodeState` holds, per layer, a group's prompt keys/values followed by its ``n`` rows' generated tokens
(token-major), and a bias that lets each row see its group's prompt and its own tokens only;
:func:`attend_cached` is the whole decode attention of a step over it (one matrix product of a group's queries with
its cache, one softmax, one product with the values), and :func:`shared_prefix_attention` hands it to a model's
own forward through transformers' attention interface. :class:`LaneStates` decodes several states (groups of
different sizes) in one forward.

Simplifications: the prompt regions are padded to the longest prompt of the batch and the generated-token regions
grow by doubling up to ``max_tokens`` (masked and exact, but not a paged block table); each query also meets its
group's other rows' tokens (masked: ``n`` times the arithmetic of that part: cheap next to the per-operator cost
over tens of generated tokens, the larger part of a step over hundreds; the engine's ``attention: rows`` decodes in
groups of one instead, each row with its own copy of the prompt).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from rlflow.rollout import decode_ops

ATTENTION_NAME = "rlflow_shared_prefix"


class DecodeState:
    """The KV cache of a decode batch: one cache per group holding its prompt and its rows' generated tokens.

    It stands in for transformers' ``Cache`` during decode steps (the model calls :meth:`update`) and is passed
    down to the attention function as ``rlflow_decode_state``, so :func:`shared_prefix_attention` finds everything
    it needs in one object.

    The batch is whole groups in order (row ``g * n + s`` is sample ``s`` of group ``g``; rows leave by whole
    groups). Layout, per layer: ``k/v[layer]`` ``[groups, kv_heads, prompt_width + n * capacity, head_dim]``.
    Columns ``[0, prompt_width)`` hold the group's prompt: the rollout-wide head (``head``, keys/values
    ``[kv_heads, head_len, head_dim]`` per layer, prefilled once and copied in front of each group's own tokens
    when the group joins), then the group's padded rest. Column ``prompt_width + t * n + s`` holds row ``s``'s
    ``t``-th generated token, so the first ``t`` tokens of every row are one contiguous slice and ``capacity``
    grows by appending. ``bias`` ``[groups, n, columns]`` is 0 where a row may look (the group's real prompt
    tokens, its own generated slots) and -inf elsewhere, so one matrix product of a group's ``n * rep`` queries
    with its cache, one softmax and one product with the values make the whole decode attention.

    While every group has fed the same number of tokens (``fed``; the groups admitted together, the usual case)
    a step writes one slice and needs no mask beyond ``bias``. Groups that join later switch the state to
    per-group lengths (``group_len``) and a per-step mask of the slots not written yet; compaction that leaves
    groups of one length switches back. Finished rows of a live group keep decoding into their own slots, which
    nobody else reads.
    """

    def __init__(
        self, n: int, max_tokens: int, head: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None
    ) -> None:
        self.n = n
        self.head_k, self.head_v = head if head is not None else (None, None)
        self.max_tokens = max_tokens
        self.capacity = min(max_tokens, 32)  # generated-token slots per row; grows (doubling) up to max_tokens
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.prompt_width = 0
        self.prompt_bias: torch.Tensor | None = None  # [groups, prompt_width]
        self.bias: torch.Tensor | None = None  # [groups, n, prompt_width + n * capacity]
        self.fed: int | None = 0  # tokens fed by every group when all agree (uniform mode), else None
        self.group_len: torch.Tensor | None = None  # per-group tokens fed (per-group mode only)
        self.group_prompt: list[int] = []  # prompt index of each group
        self.step_bias: torch.Tensor | None = None
        self.step_width = 0
        self._query_bias: tuple[tuple, torch.Tensor] | None = None  # query_bias's of this step

    @property
    def num_groups(self) -> int:
        return len(self.group_prompt)

    # -------------------------------------------------------------------- transformers' cache protocol
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the step's key/value (``[rows, kv_heads, 1, dim]``) in each row's next generated-token slot."""
        self.write(layer_idx, key_states[:, :, 0], value_states[:, :, 0])
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        fed = self.fed if self.fed is not None else int(self.group_len.max())
        return self.prompt_width + fed

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store the step's ``key``/``value`` (``[rows, kv_heads, dim]``) in each row's next generated-token slot."""
        groups, n = self.num_groups, self.n
        key, value = (t.view(groups, n, *t.shape[1:]).transpose(1, 2) for t in (key, value))  # [groups, kv, n, dim]
        if self.fed is not None:
            start = self.prompt_width + self.fed * n
            self.k[layer][:, :, start: start + n] = key
            self.v[layer][:, :, start: start + n] = value
        else:
            cols = self.prompt_width + self.group_len[:, None] * n + torch.arange(n, device=key.device)  # [groups, n]
            g = torch.arange(groups, device=key.device)[:, None]
            self.k[layer][g, :, cols] = key.transpose(1, 2)
            self.v[layer][g, :, cols] = value.transpose(1, 2)

    # ------------------------------------------------------------------------------- batch bookkeeping
    def _suffix_bias(self, groups: int, device: torch.device) -> torch.Tensor:
        """``[groups, n, n * capacity]``: row ``s`` sees the generated-token columns ``t * n + s``."""
        cols = torch.arange(self.n * self.capacity, device=device)
        own = (cols[None, :] % self.n) == torch.arange(self.n, device=device)[:, None]
        bias = torch.zeros(own.shape, dtype=self.prompt_bias.dtype, device=device).masked_fill(~own, float("-inf"))
        return bias.expand(groups, -1, -1)

    def _rebuild_bias(self) -> None:
        groups, device = self.num_groups, self.prompt_bias.device
        prompt = self.prompt_bias[:, None, :].expand(-1, self.n, -1)
        self.bias = torch.cat([prompt, self._suffix_bias(groups, device)], dim=2).contiguous()

    def _group_cache(
        self, head: torch.Tensor | None, rest: torch.Tensor, width: int, zero_generated: bool
    ) -> torch.Tensor:
        """One layer's cache of new groups: ``head`` (``[kv, head_len, d]``) and ``rest`` (``[g, kv, w, d]``) in the
        prompt region of ``width`` columns, zeros after them (masked, but finite). The generated region is zeroed
        only for groups that join behind running ones (their unwritten slots are read, masked); otherwise every
        slot a step reads was written by that step or an earlier one."""
        groups, kv_heads, w, dim = rest.shape
        h = 0 if head is None else head.shape[1]
        cache = rest.new_empty((groups, kv_heads, width + self.n * self.capacity, dim))
        if h:
            cache[:, :, :h] = head
        cache[:, :, h: h + w] = rest
        cache[:, :, h + w: None if zero_generated else width].zero_()
        return cache

    def add_groups(
        self, prompt_ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor
    ) -> None:
        """Add prefilled groups: per-layer ``[groups, kv_heads, width, dim]`` caches (of the prompts after the
        rollout-wide head, if any) and their 2D ``mask``."""
        g_new = len(prompt_ids)
        device = keys[0].device
        if self.head_k is not None:
            mask = torch.cat([mask.new_ones((g_new, self.head_k[0].shape[1])), mask], dim=1)
        width = max(self.prompt_width, mask.shape[1])
        bias = torch.zeros((g_new, width), dtype=keys[0].dtype, device=device)
        bias[:, : mask.shape[1]].masked_fill_(mask == 0, float("-inf"))
        bias[:, mask.shape[1]:] = float("-inf")
        heads_k = self.head_k if self.head_k is not None else [None] * len(keys)
        heads_v = self.head_v if self.head_v is not None else [None] * len(values)
        behind = self.prompt_bias is not None and self.fed != 0  # joining groups that have already decoded
        new_k = [self._group_cache(h, k, width, behind) for h, k in zip(heads_k, keys)]
        new_v = [self._group_cache(h, v, width, behind) for h, v in zip(heads_v, values)]
        if self.prompt_bias is None:
            self.k, self.v, self.prompt_bias = new_k, new_v, bias
            self.fed, self.group_len = 0, None
        else:
            old = self.prompt_width

            def widen(t: torch.Tensor) -> torch.Tensor:  # a longer prompt joined: more prompt columns
                if old == width:
                    return t
                pad = t.new_zeros(t.shape[:2] + (width - old, t.shape[3]))
                return torch.cat([t[:, :, :old], pad, t[:, :, old:]], dim=2)

            self.k = [torch.cat([widen(a), b]) for a, b in zip(self.k, new_k)]
            self.v = [torch.cat([widen(a), b]) for a, b in zip(self.v, new_v)]
            self.prompt_bias = torch.cat([
                torch.nn.functional.pad(self.prompt_bias, (0, width - old), value=float("-inf")), bias])
            if self.fed != 0:  # the new groups start behind the running ones: per-group lengths from now on
                lens = self.group_len if self.fed is None else torch.full((self.num_groups,), self.fed, device=device)
                self.group_len, self.fed = torch.cat([lens, lens.new_zeros(g_new)]), None
        self.prompt_width = width
        self.group_prompt.extend(prompt_ids)
        self._rebuild_bias()
        self._query_bias = None

    def keep_rows(self, keep: torch.Tensor) -> None:
        """Keep rows ``keep`` (in order), which must be whole groups; free the caches of the other groups."""
        n = self.n
        rows = keep.view(-1, n) if keep.numel() % n == 0 else None
        whole = rows is not None and torch.equal(rows, rows[:, :1] + torch.arange(n, device=keep.device))
        if not whole or bool((rows[:, 0] % n).any()):
            raise ValueError(f"DecodeState.keep_rows keeps whole groups of {n} rows in order; got rows {keep.tolist()}")
        live = rows[:, 0] // n
        self._query_bias = None
        self.k = [t[live] for t in self.k]
        self.v = [t[live] for t in self.v]
        self.prompt_bias = self.prompt_bias[live]
        self.bias = self.bias[live]
        self.group_prompt = [self.group_prompt[g] for g in live.tolist()]
        if self.fed is None:
            self.group_len = self.group_len[live]
            if self.group_len.numel() and int(self.group_len.min()) == int(self.group_len.max()):
                self.fed, self.group_len = int(self.group_len[0]), None  # one length again: uniform mode

    def begin_step(self) -> None:
        """Size the step's view of the caches (the groups' fed tokens plus the one fed now) and, with per-group
        lengths, mask the slots a group has not written yet."""
        self._query_bias = None
        fed = self.fed if self.fed is not None else int(self.group_len.max())
        if fed + 1 > self.capacity:  # grow the generated-token region (appended: token-major columns)
            grow = min(self.max_tokens, max(fed + 1, 2 * self.capacity)) - self.capacity
            self.k = [torch.nn.functional.pad(t, (0, 0, 0, grow * self.n)) for t in self.k]
            self.v = [torch.nn.functional.pad(t, (0, 0, 0, grow * self.n)) for t in self.v]
            self.capacity += grow
            self._rebuild_bias()
        self.step_width = self.prompt_width + (fed + 1) * self.n
        if self.fed is not None:
            self.step_bias = None
            return
        slot = torch.arange(self.step_width - self.prompt_width, device=self.group_len.device) // self.n
        unwritten = torch.nn.functional.pad(slot[None, :] > self.group_len[:, None], (self.prompt_width, 0))
        self.step_bias = torch.zeros(unwritten.shape, dtype=self.bias.dtype, device=unwritten.device).masked_fill(
            unwritten, float("-inf"))

    def attend(self, layer: int, query: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        return attend_cached(self, layer, query, scaling)

    def write_attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float | None = None, compiled: bool = False) -> torch.Tensor:
        """:meth:`write` the step's ``key``/``value`` (``[rows, kv_heads, 1, dim]``), then :meth:`attend`:
        ``[rows, heads * dim]``. ``compiled`` (float32 caches): both in one :func:`rlflow.rollout.decode_ops.attend`
        call (a per-group-lengths step writes first, as :meth:`write` does)."""
        if compiled and self.k[layer].dtype == torch.float32:
            start = self.prompt_width + self.fed * self.n if self.fed is not None else -1
            if start < 0:
                self.write(layer, key[:, :, 0], value[:, :, 0])
            scale = query.shape[-1] ** -0.5 if scaling is None else scaling
            return decode_ops.attend(query[:, :, 0], key[:, :, 0], value[:, :, 0], self.k[layer], self.v[layer], start,
                                     self.bias, self.step_bias, self.step_width, self.n, scale)
        self.write(layer, key[:, :, 0], value[:, :, 0])
        return self.attend(layer, query, scaling).reshape(query.shape[0], -1)

    def query_bias(self, rep: int, dtype: torch.dtype) -> torch.Tensor:
        """The step's mask for a group's ``n * rep`` queries (``rep`` query heads per key/value head) in
        :func:`attend_cached`'s fused call: ``[groups, 1, n * rep, step_width]`` (``[groups, 1, 1, step_width]``,
        broadcast, for groups of one), ``bias`` plus the unwritten slots' mask, in ``dtype``. Built once per step:
        every layer's call reads the same one."""
        key = (rep, dtype, self.step_width)
        if self._query_bias is not None and self._query_bias[0] == key:
            return self._query_bias[1]
        groups, n, width = self.num_groups, self.n, self.step_width
        if n == 1:
            bias = self.bias[:, :, None, :width]
        else:
            bias = self.bias[:, None, :, None, :width].expand(groups, 1, n, rep, width).reshape(groups, 1, n * rep,
                                                                                                  width)
        if self.step_bias is not None:
            bias = bias + self.step_bias[:, None, None, :]
        bias = bias.to(dtype)
        self._query_bias = (key, bias)
        return bias

    def end_step(self) -> None:
        if self.fed is not None:
            self.fed += 1
        else:  # a group with no live row left (not compacted yet) rewrites its last slot
            self.group_len = (self.group_len + 1).clamp(max=self.max_tokens - 1)


def shared_prefix_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: Any, scaling: float | None = None, rlflow_decode_state: Any = None,
                            **kwargs: Any):
    """Decode-step attention over a group's shared prompt cache plus each row's own generated tokens.

    ``query`` is ``[rows, heads, 1, dim]``; the :class:`DecodeState` comes as the ``rlflow_decode_state`` keyword
    argument (the model's forward passes extra keyword arguments down to its attention function; the attention
    mask is not used for it, because many models rebuild their mask instead of passing a given one through).
    Returns ``([rows, 1, heads, dim], None)`` as transformers' attention functions do.
    """
    return rlflow_decode_state.attend(module.layer_idx, query, scaling), None


def attend_cached(state: DecodeState, layer: int, query: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
    """The maths of :func:`shared_prefix_attention`: ``query`` ``[rows, heads, 1, dim]`` -> ``[rows, 1, heads, dim]``.

    A group's ``n * rep`` queries (``rep`` query heads per key/value head) against its one cache (prompt and
    generated tokens) in one matrix product, masked by the state's bias, one softmax, one product with values.
    """
    rows, heads, _, dim = query.shape
    cache_k, cache_v = state.k[layer], state.v[layer]
    groups, kv_heads, _, _ = cache_k.shape
    rep, n, width = heads // kv_heads, state.n, state.step_width
    scale = dim ** -0.5 if scaling is None else scaling
    q = query.reshape(groups, n, kv_heads, rep, dim).transpose(1, 2).reshape(groups, kv_heads, n * rep, dim)
    keys, values = cache_k[:, :, :width], cache_v[:, :, :width]
    if cache_k.dtype != torch.float32:  # half-precision caches: one fused kernel (float32 accumulation inside)
        bias = state.query_bias(rep, keys.dtype)
        out = F.scaled_dot_product_attention(q.to(keys.dtype), keys, values, attn_mask=bias, scale=scale)
        return out.view(groups, kv_heads, n, rep, dim).transpose(1, 2).reshape(rows, 1, heads, dim).to(query.dtype)
    if scale != 1.0:
        q = q * scale
    scores = torch.matmul(q, keys.transpose(-1, -2))  # [groups, kv, n * rep, width]
    scores.view(groups, kv_heads, n, rep, width).add_(state.bias[:, None, :, None, :width].float())
    if state.step_bias is not None:
        scores.add_(state.step_bias[:, None, None, :].float())
    out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [groups, kv, n * rep, dim]
    return out.view(groups, kv_heads, n, rep, dim).transpose(1, 2).reshape(rows, 1, heads, dim).to(query.dtype)


AttentionInterface.register(ATTENTION_NAME, shared_prefix_attention)


class LaneStates:
    """Several :class:`DecodeState` s decoded in one forward: their rows one after the other.

    Why: a state holds groups of one size ``n`` (and one shared head); a multi-turn rollout decodes its first turn's
    groups of ``n`` next to trajectories' later turns (groups of one, continued from kept caches) in the same
    steps. Each layer's step keys/values and queries are split by rows, each state attends its own rows."""

    def __init__(self, states: list[DecodeState]) -> None:
        self.states = states
        self.sizes = [s.num_groups * s.n for s in states]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self.write(layer_idx, key_states[:, :, 0], value_states[:, :, 0])
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(s.get_seq_length(layer_idx) for s in self.states)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> None:
        for state, k, v in zip(self.states, key.split(self.sizes), value.split(self.sizes)):
            state.write(layer, k, v)

    def attend(self, layer: int, query: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
        return torch.cat([attend_cached(state, layer, q, scaling)
                          for state, q in zip(self.states, query.split(self.sizes))])

    def write_attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     scaling: float | None = None, compiled: bool = False) -> torch.Tensor:
        parts = zip(self.states, query.split(self.sizes), key.split(self.sizes), value.split(self.sizes))
        return torch.cat([state.write_attend(layer, q, k, v, scaling, compiled) for state, q, k, v in parts])

    def begin_step(self) -> None:
        for state in self.states:
            state.begin_step()

    def end_step(self) -> None:
        for state in self.states:
            state.end_step()
