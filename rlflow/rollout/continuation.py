"""Continuing a trajectory from its own KV cache across the turns of a multi-turn rollout (the ``engine`` backend).

Why: a multi-turn rollout (:mod:`rlflow.rollout.multiturn`) calls the backend once per turn with the whole
trajectory so far as the prompt (prompt, sampled turns, inserted tool/environment tokens). Prefilling it again
every turn costs a forward over the history each turn (quadratic in the number of turns). Inside
:meth:`EngineRollout.keep_caches <rlflow.rollout.engine.EngineRollout.keep_caches>` the engine instead

* keeps, when a group finishes, each row's own keys/values (its prompt's real columns, then its generated slots
  but the last token's, which was sampled and never fed) in a :class:`SessionCache` under the token ids they
  cover;
* on a later call, finds each prompt's longest kept prefix, takes that cache out and prefills only the tokens
  after it (the last sampled token and the inserted ones) on top of it (:func:`prefill_on_caches`); the
  trajectory then joins the decode batch as a group of one whose prompt cache is the kept one plus the new
  tokens.

Keys are stored after RoPE at the positions the tokens had, so a kept cache is valid for exactly the token ids it
was computed from, under the weights of that moment: a session must not outlive an optimizer step (the
multi-turn loop opens one per rollout call). Simplifications: the lookup is by exact token-id prefix (a dict per
kept length, no radix tree); a kept cache is a copy (``[kv_heads, length, head_dim]`` per layer); caches of
trajectories that end are dropped only when the session closes; through the model's own forward (architectures
the fused decoder does not cover) continuations are prefilled one trajectory per forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from rlflow.rollout.engine_support import cache_kwargs

Cache = tuple[list[torch.Tensor], list[torch.Tensor]]  # per-layer keys, values: [kv_heads, length, head_dim]


class SessionCache:
    """The per-trajectory KV caches kept between the calls of one multi-turn rollout, found by token-id prefix."""

    def __init__(self) -> None:
        self.entries: dict[int, dict[tuple[int, ...], list[Cache]]] = {}  # length -> ids -> caches

    def __len__(self) -> int:
        return sum(len(caches) for by_ids in self.entries.values() for caches in by_ids.values())

    def put(self, ids: list[int], cache: Cache) -> None:
        """Keep ``cache``, the keys/values of the tokens ``ids``."""
        if ids:
            self.entries.setdefault(len(ids), {}).setdefault(tuple(ids), []).append(cache)

    def take(self, prompt: list[int]) -> tuple[int, Cache] | None:
        """Remove and return ``(length, cache)`` of the longest kept prefix of ``prompt`` that leaves at least one
        token to prefill, or None."""
        for length in sorted(self.entries, reverse=True):
            if length >= len(prompt):
                continue
            by_ids = self.entries[length]
            caches = by_ids.get(tuple(prompt[:length]))
            if caches:
                cache = caches.pop()
                if not caches:
                    del by_ids[tuple(prompt[:length])]
                return length, cache
        return None


def row_caches(state: Any, group: int, fed: list[int]) -> list[Cache]:
    """The caches of the rows of ``group`` of a :class:`~rlflow.rollout.decode_state.DecodeState`: row ``s``'s are its
    prompt's real columns, then its first ``fed[s]`` generated-token slots (token-major: column
    ``prompt_width + t * n + s``). One gather per layer for the whole group; each row's cache is a view of it."""
    prompt_cols = torch.nonzero(torch.isfinite(state.prompt_bias[group])).squeeze(1)
    device, most = prompt_cols.device, max(fed)
    slots = torch.arange(most, device=device)[None, :] * state.n + torch.arange(len(fed), device=device)[:, None]
    cols = torch.cat([prompt_cols.expand(len(fed), -1), state.prompt_width + slots], dim=1)  # [n, columns]
    keys = [k[group][:, cols] for k in state.k]  # [kv, n, columns, dim]
    values = [v[group][:, cols] for v in state.v]
    ends = [prompt_cols.numel() + f for f in fed]
    return [([k[:, s, :end] for k in keys], [v[:, s, :end] for v in values]) for s, end in enumerate(ends)]


def _pad_to(t: torch.Tensor, width: int) -> torch.Tensor:
    """Right-pad dimension 2 (cache columns) of ``[batch, kv, columns, dim]`` (or dimension 1 of a mask) to
    ``width``."""
    if t.dim() == 2:
        return F.pad(t, (0, width - t.shape[1]))
    return F.pad(t, (0, 0, 0, width - t.shape[2]))


def merge_prefills(parts: list[tuple[list[int], tuple]], batch: int):
    """Merge ``(row indices, (keys, values, mask, logits))`` prefill results into one batch in row order (cache
    widths right-padded, the padding masked)."""
    parts = [p for p in parts if p[0]]
    if len(parts) == 1 and parts[0][0] == list(range(batch)):
        return parts[0][1]
    width = max(r[2].shape[1] for _, r in parts)
    at = torch.empty(batch, dtype=torch.long)  # row i of the merged batch is row at[i] of the concatenation
    at[torch.tensor([i for idx, _ in parts for i in idx])] = torch.arange(batch)
    at = at.to(parts[0][1][3].device)

    def merged(get) -> torch.Tensor:
        return torch.cat([_pad_to(get(r), width) for _, r in parts])[at]

    layers = range(len(parts[0][1][0]))
    keys = [merged(lambda r, layer=layer: r[0][layer]) for layer in layers]
    values = [merged(lambda r, layer=layer: r[1][layer]) for layer in layers]
    return keys, values, merged(lambda r: r[2]), torch.cat([r[3] for _, r in parts])[at]


def prefill_on_caches(engine: Any, prompts: list[list[int]], kept: list[tuple[int, Cache]], device: torch.device):
    """Prefill ``prompts[i][length_i:]`` on top of the kept cache of ``prompts[i][:length_i]``; return per-layer keys
    and values ``[batch, kv, width, dim]`` of the whole prompts (kept columns, then new), their 2D mask and each
    prompt's last logits, as :meth:`EngineRollout._prefill <rlflow.rollout.engine.EngineRollout._prefill>` does."""
    if engine._decoder is None:
        parts = [([i], _prefill_one_through_model(engine, p, c, device)) for i, (p, c) in enumerate(zip(prompts, kept))]
        return merge_prefills(parts, len(prompts))
    decoder = engine._decoder
    batch = len(prompts)
    lengths = torch.tensor([length for length, _ in kept])
    news = [p[length:] for p, (length, _) in zip(prompts, kept)]
    width, kept_width = max(len(r) for r in news), int(lengths.max())
    heads, kv_heads, dim = decoder.num_heads, decoder.num_kv_heads, decoder.head_dim
    ids = torch.full((batch, width), engine.pad_id, dtype=torch.long)
    for i, r in enumerate(news):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    new_len = torch.tensor([len(r) for r in news])
    cols, kept_cols = torch.arange(width), torch.arange(kept_width)
    real = cols[None, :] < new_len[:, None]
    kept_real = kept_cols[None, :] < lengths[:, None]
    allowed = torch.zeros((batch, 1, width, kept_width + width), dtype=torch.bool)
    allowed[..., :kept_width] = kept_real[:, None, None, :]
    allowed[..., kept_width:] = (cols[None, :] <= cols[:, None]) & real[:, None, None, :]
    positions = (lengths[:, None] + cols[None, :]).reshape(-1)
    ids, real, kept_real, allowed, positions, new_len = (
        t.to(device) for t in (ids, real, kept_real, allowed, positions, new_len))
    old_k = [torch.stack([_pad_to(c[0][layer][None], kept_width)[0] for _, c in kept])
             for layer in range(len(kept[0][1][0]))]
    old_v = [torch.stack([_pad_to(c[1][layer][None], kept_width)[0] for _, c in kept])
             for layer in range(len(kept[0][1][1]))]
    keys, values = [], []

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        q = q.view(batch, width, heads, dim).transpose(1, 2)
        k = torch.cat([old_k[layer], k.view(batch, width, kv_heads, dim).transpose(1, 2)], dim=2)
        v = torch.cat([old_v[layer], v.view(batch, width, kv_heads, dim).transpose(1, 2)], dim=2)
        keys.append(k)
        values.append(v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling, enable_gqa=heads != kv_heads)
        return out.transpose(1, 2).reshape(batch * width, heads * dim)

    last = torch.arange(batch, device=device) * width + new_len - 1
    logits = decoder.step(ids.view(-1), positions, attend, select=last)
    return keys, values, torch.cat([kept_real, real], dim=1).long(), logits


def _prefill_one_through_model(engine: Any, prompt: list[int], kept: tuple[int, Cache], device: torch.device):
    """:func:`prefill_on_caches` of one prompt through the model's own forward (a cache preloaded with the kept
    keys/values, position ids continuing after them)."""
    length, (old_k, old_v) = kept
    cache = DynamicCache(config=engine.model.config)
    for layer, (k, v) in enumerate(zip(old_k, old_v)):
        cache.update(k[None], v[None], layer)
    new = prompt[length:]
    out = engine.model(
        input_ids=torch.tensor([new], device=device), attention_mask=torch.ones((1, len(prompt)), device=device,
                                                                                dtype=torch.long),
        position_ids=torch.arange(length, len(prompt), device=device)[None], use_cache=True, logits_to_keep=1,
        **cache_kwargs(engine.model, cache),
    )
    keys = [layer.keys for layer in cache.layers]
    values = [layer.values for layer in cache.layers]
    return keys, values, torch.ones((1, len(prompt)), dtype=torch.long, device=device), out.logits[:, -1]
