"""Causal attention within each sequence of a pack, in memory linear in the pack's tokens.

A pack (:mod:`rlflow.training.packing`) is one row of sequences laid end to end. Its attention is described by
*attention rows*: each row attends causally over its keys (flat token positions of the pack), and its queries are
its keys from index ``first`` on. A plain sequence is one row (``first`` 0); with shared prompts a group's prompt is
a row of its own and each member's completion another, whose queries (the completion) see the prompt and their own
earlier tokens. Every pack position is the query of exactly one row. :func:`attention_layout` turns the rows into
tensors a batch carries; :func:`varlen_sdpa_attention` (registered with transformers' ``AttentionInterface`` as
:data:`ATTENTION_NAME`) attends them, picking a plan once per forward and device:

* **CUDA, fp16/bf16**: one variable-length flash call over every row (``flash_attn_varlen_func`` where flash-attn
  is installed, else ``torch.nn.attention.varlen.varlen_attn``). Rows go in as sequences with their own query and
  key lengths (``cu_seqlens``), causal aligned to the bottom right, which is exactly a row behind a shared prefix.
* **Elsewhere (the CPU; CUDA float32)**: ``scaled_dot_product_attention``. A row with more than :data:`LONG_ROW`
  keys is attended alone: without a prefix through ``is_causal`` and no mask at all (CPU sdpa then runs its
  flash-style kernel, whose memory is linear in the row), behind a prefix in chunks of :data:`QUERY_CHUNK` queries,
  each with a ``[chunk, keys]`` mask. Shorter rows are batched in sets padded to their widest row with a
  ``[rows, 1, queries, keys]`` mask: one call per set instead of one per row, which is what keeps many short rows
  fast on a CPU. On a CPU a set that would compute in 16 bits (a 16-bit model, or ``bf16-mixed`` autocast) is
  attended in float32 and rounded once (:func:`_masked_sdpa`: torch's masked 16-bit CPU kernel is the slower one).

What is bounded by what: no tensor of the plans grows with the square of the pack. A short row's mask holds at most
``LONG_ROW x LONG_ROW`` entries (a set whose padded mask passes :data:`MASK_SPLIT` entries is split at its median
width); a long row behind a prefix holds ``QUERY_CHUNK x (prefix + row)`` at a time; a long row without one holds
none. So memory is linear in the pack's tokens, and in a single sequence's length (for rows behind a shared prefix:
in the prefix plus the row). Gradient checkpointing changes none of this (:func:`rlflow.training.packing.
_varlen_attention` runs the recomputation under this attention too).

Why these kernels: the alternatives are worse here. A block-diagonal ``tokens x tokens`` mask (what transformers'
sdpa path builds for packed position ids) is quadratic in memory and attends every masked block; torch's varlen API
runs only on CUDA's flash kernels; ``flex_attention`` needs ``torch.compile`` (a C++ toolchain, and a recompile for
each new pack shape) to run blockwise on a CPU, and run eagerly it evaluates the whole score matrix. Per-row causal
calls cost one kernel launch per long row, which at more than :data:`LONG_ROW` keys is small next to the row's own
attention, and their causal kernel skips the blocks above the diagonal that a masked call computes.

Simplifications: rows are attended as full causal attention (no sliding windows, soft-capping or sinks: the fit-start
probe of :mod:`rlflow.training.packing_support` refuses models whose packed log-probs would differ); the short sets
are chosen by :func:`rlflow.training.packing.collate_packed`, the plan only splits them further.
"""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import AttentionInterface

from rlflow.data.experience import flat_tensor

ATTENTION_NAME = "rlflow_varlen_sdpa"
#: Attention row sets of a pack for the padded (CPU) plan: 0 queries = keys (a whole sequence, a shared prompt or
#: head), 1 completions behind a shared prompt (3: the longer half of them, see
#: :data:`rlflow.training.packing.SPLIT_COMPLETION_ROWS`), 2 prompt tails behind a head.
ROW_SETS = (0, 1, 2, 3)
#: Rows with more keys than this are attended one by one (no padding; no mask without a prefix); shorter ones in
#: padded sets, one call per set.
LONG_ROW = 256
#: Queries per call of a long row behind a shared prefix: its mask is ``QUERY_CHUNK x keys`` at a time.
QUERY_CHUNK = 256
#: A padded set whose mask (rows x queries x keys) has more entries than this is split at its median key width.
MASK_SPLIT = 1 << 22


def rows_layout(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``index`` ``[sequences, longest]``: each attention row's flat token positions (0 past its end), and
    ``valid``, the real entries."""
    width = max(len(r) for r in rows)
    flat: list[int] = []
    for r in rows:  # one tensor from one flat list, not one per row
        flat.extend(r)
        flat.extend([0] * (width - len(r)))
    index = flat_tensor(flat, torch.long).view(len(rows), width)
    valid = torch.arange(width)[None, :] < flat_tensor([len(r) for r in rows], torch.long)[:, None]
    return index, valid


def attention_layout(rows: list[tuple[list[int], int, int]]) -> dict[str, torch.Tensor]:
    """The tensors :func:`varlen_sdpa_attention` needs, for attention rows ``(key positions, first query, set)``.

    Each row attends causally over its keys; its queries are its keys from index ``first query`` on; ``set`` (one of
    :data:`ROW_SETS`) groups short rows for the padded plan. Every pack position must be a query of exactly one row.
    Returns ``attn_rows`` ``[rows, 3]`` (first query, key count, set) and ``attn_keys`` (every row's key positions,
    end to end); equal-length rows laid end to end with nothing shared only get ``attn_full`` (rows, width):
    attention is then a reshape.
    """
    widths = {len(keys) for keys, _, _ in rows}
    if all(first == 0 for _, first, _ in rows) and len(widths) == 1:
        width = widths.pop()
        if [k for keys, _, _ in rows for k in keys] == list(range(len(rows) * width)):
            return {"attn_full": torch.tensor([len(rows), width])}
    for _, _, row_set in rows:
        if row_set not in ROW_SETS:
            raise ValueError(f"attention_layout: row set {row_set} is not one of {ROW_SETS}")
    queries = sorted(k for keys, first, _ in rows for k in keys[first:])
    if queries != list(range(len(queries))):
        raise ValueError("attention_layout: every pack position must be the query of exactly one row")
    described = [x for keys, first, row_set in rows for x in (first, len(keys), row_set)]
    return {"attn_rows": flat_tensor(described, torch.long).view(-1, 3),
            "attn_keys": flat_tensor([k for keys, _, _ in rows for k in keys], torch.long)}


def _rows(layout: dict) -> tuple[list[list[int]], list[list[int]]]:
    """The layout's rows with queries as ``[first, keys, set]`` and their key positions (one host copy per
    forward)."""
    flat = layout["attn_keys"].tolist()
    rows, keys, start = [], [], 0
    for first, n, row_set in layout["attn_rows"].tolist():
        if first < n:  # a row without queries has no output
            rows.append([first, n, row_set])
            keys.append(flat[start: start + n])
        start += n
    return rows, keys


def _index(positions: list[int], device: torch.device) -> torch.Tensor | None:
    """``positions`` as a gather index on ``device``; None where they are 0, 1, 2, ... (no gather needed)."""
    if positions == list(range(len(positions))):
        return None
    return flat_tensor(positions, torch.long).to(device)


def _inverse(order: list[int]) -> list[int]:
    """Where each pack position sits in ``order`` (a permutation of the positions)."""
    inverse = [0] * len(order)
    for place, position in enumerate(order):
        inverse[position] = place
    return inverse


def _padded_groups(members: list[int], rows: list[list[int]]) -> list[list[int]]:
    """``members`` (row indices of one set) in groups whose padded mask stays under :data:`MASK_SPLIT` entries, or
    whose key widths are all equal (split at the median key width, recursively)."""
    q_width = max(rows[i][1] - rows[i][0] for i in members)
    k_width = max(rows[i][1] for i in members)
    if len(members) < 2 or len(members) * q_width * k_width <= MASK_SPLIT:
        return [members]
    widths = sorted(rows[i][1] for i in members)
    median = widths[len(widths) // 2]
    wide = [i for i in members if rows[i][1] > median] or [i for i in members if rows[i][1] >= median]
    chosen = set(wide)
    narrow = [i for i in members if i not in chosen]
    if not narrow:
        return [members]
    return _padded_groups(narrow, rows) + _padded_groups(wide, rows)


def _sets_plan(layout: dict, device: torch.device) -> dict:
    """The padded plan: short rows in sets (padded indices and a mask each), long rows one by one; gathers of every
    set's and long row's queries and keys end to end (one ``index_select`` each) and of the outputs back."""
    rows, keys = _rows(layout)
    short: dict[int, list[int]] = {}
    long_rows = []
    for i, (_, n, row_set) in enumerate(rows):
        if n > LONG_ROW:
            long_rows.append(i)
        else:
            short.setdefault(row_set, []).append(i)
    groups = [group for s in sorted(short) for group in _padded_groups(short[s], rows)]
    order: list[int] = []
    q_all: list[int] = []
    k_all: list[int] = []
    takes, sets, offset = [], [], 0
    for group in groups:
        k_index, k_valid = rows_layout([keys[i] for i in group])
        q_index, q_valid = rows_layout([keys[i][rows[i][0]:] for i in group])
        q_col = torch.tensor([rows[i][0] for i in group])[:, None] + torch.arange(q_index.shape[1])[None, :]
        mask = (torch.arange(k_index.shape[1])[None, None, :] <= q_col[:, :, None]) & k_valid[:, None, :]
        take = q_valid.reshape(-1).nonzero().squeeze(1)
        sets.append((tuple(q_index.shape), tuple(k_index.shape), mask.unsqueeze(1).to(device)))
        order.extend(q_index.reshape(-1)[take].tolist())
        q_all.extend(q_index.reshape(-1).tolist())
        k_all.extend(k_index.reshape(-1).tolist())
        takes.extend((take + offset).tolist())
        offset += q_index.numel()
    long_shapes = []
    for i in long_rows:
        first, n, _ = rows[i]
        order.extend(keys[i][first:])
        q_all.extend(keys[i][first:])
        k_all.extend(keys[i])
        takes.extend(range(offset, offset + n - first))
        offset += n - first
        long_shapes.append((n - first, n, first))
    out = [takes[j] for j in _inverse(order)]
    out_index = _index(out, device) if offset == len(out) else flat_tensor(out, torch.long).to(device)  # padding
    return {"q_index": _index(q_all, device), "k_index": _index(k_all, device), "out_index": out_index,
            "q_sizes": [q[0] * q[1] for q, _, _ in sets] + [s[0] for s in long_shapes],
            "k_sizes": [k[0] * k[1] for _, k, _ in sets] + [s[1] for s in long_shapes],
            "sets": sets, "long": long_shapes}


def _varlen_plan(layout: dict, device: torch.device) -> dict:
    """The variable-length plan: every row's queries and keys end to end, their cumulative lengths (int32) and
    longest lengths, and the gather of the outputs back to pack order."""
    rows, keys = _rows(layout)
    queries = [p for (first, _, _), k in zip(rows, keys) for p in k[first:]]
    q_lengths = [n - first for first, n, _ in rows]
    k_lengths = [n for _, n, _ in rows]
    cumulative = [torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
                  for lengths in (q_lengths, k_lengths)]
    return {"q_index": _index(queries, device), "k_index": _index([p for k in keys for p in k], device),
            "out_index": _index(_inverse(queries), device), "cu_q": cumulative[0], "cu_k": cumulative[1],
            "max_q": max(q_lengths), "max_k": max(k_lengths)}


def _token_major(states: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """``[1, heads, tokens, dim]`` states as ``[tokens, heads, dim]`` (the projections' own memory order), gathered
    at ``index`` (one ``index_select``: its backward is one ``index_add_`` over whole token rows)."""
    states = states.squeeze(0).transpose(0, 1)  # squeeze, not [0], whose backward builds a zero tensor per use
    return states if index is None else states.index_select(0, index)


def _long_row(q, k, v, first: int, scale, dropout_p: float, gqa: bool) -> torch.Tensor:
    """One long row's attention, ``[queries, heads, dim]`` token-major in and out: without a prefix one causal
    call and no mask; behind one, :data:`QUERY_CHUNK` queries at a time, each over the keys up to its last query."""
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if first == 0:
        out = sdpa(q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p, enable_gqa=gqa)
    else:
        outs = []
        for start, chunk in zip(range(0, q.shape[2], QUERY_CHUNK), q.split(QUERY_CHUNK, dim=2)):
            end = first + start + chunk.shape[2]
            seen = torch.arange(end, device=q.device)[None, :]
            mask = seen <= torch.arange(first + start, end, device=q.device)[:, None]
            outs.append(sdpa(chunk, k[:, :, :end], v[:, :, :end], attn_mask=mask, scale=scale, dropout_p=dropout_p,
                             enable_gqa=gqa))
        out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
    return out.squeeze(0).transpose(0, 1)


def _masked_sdpa(q, k, v, mask, scale, dropout_p: float, gqa: bool) -> torch.Tensor:
    """``scaled_dot_product_attention`` of a padded set with its mask. On a CPU, a call that would run in 16 bits
    (16-bit states, or any states under a 16-bit autocast, which casts this function's inputs) runs in float32
    instead, its output in the dtype the 16-bit call would return: torch's CPU kernel for a masked 16-bit call runs
    its forward and backward several times slower than the float32 one at these short widths
    (``benchmarks/bench_attention.py``), and float32 scores and probabilities round less."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    low = _sixteen_bit_cpu(q)
    if low is None:
        return sdpa(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout_p, enable_gqa=gqa)
    with torch.autocast("cpu", enabled=False):  # autocast would cast the float32 copies back to 16 bits
        out = sdpa(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale, dropout_p=dropout_p, enable_gqa=gqa)
    return out.to(low)


def _sixteen_bit_cpu(q: torch.Tensor) -> torch.dtype | None:
    """The 16-bit dtype a CPU ``scaled_dot_product_attention`` of ``q`` would compute in (its own, or autocast's),
    or None (another device, or float32 throughout)."""
    if q.device.type != "cpu":
        return None
    if torch.is_autocast_enabled("cpu"):
        dtype = torch.get_autocast_dtype("cpu")
        return dtype if dtype in (torch.bfloat16, torch.float16) else None
    return q.dtype if q.dtype in (torch.bfloat16, torch.float16) else None


def _attend_sets(plan: dict, query, key, value, scale, dropout_p: float, gqa: bool) -> torch.Tensor:
    """:func:`_sets_plan`'s attention: ``[tokens, heads, dim]`` in pack order."""
    q_parts = _token_major(query, plan["q_index"]).split(plan["q_sizes"])
    k_parts = _token_major(key, plan["k_index"]).split(plan["k_sizes"])
    v_parts = _token_major(value, plan["k_index"]).split(plan["k_sizes"])
    outs = []
    for (q_shape, k_shape, mask), q, k, v in zip(plan["sets"], q_parts, k_parts, v_parts):
        q, k, v = q.unflatten(0, q_shape).transpose(1, 2), *(t.unflatten(0, k_shape).transpose(1, 2) for t in (k, v))
        out = _masked_sdpa(q, k, v, mask, scale, dropout_p, gqa)
        outs.append(out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3]))  # [rows * q_width, heads, dim]
    count = len(plan["sets"])
    for (_, _, first), q, k, v in zip(plan["long"], q_parts[count:], k_parts[count:], v_parts[count:]):
        outs.append(_long_row(q, k, v, first, scale, dropout_p, gqa))
    out = torch.cat(outs) if len(outs) > 1 else outs[0]
    return out if plan["out_index"] is None else out.index_select(0, plan["out_index"])


@functools.cache
def _flash_attn_varlen():
    """flash-attn's ``flash_attn_varlen_func`` where the package is installed, else None."""
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


@functools.cache
def _torch_varlen():
    """torch's own ``varlen_attn`` (``torch.nn.attention.varlen``, on CUDA's flash kernels) where it exists."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def varlen_kernel(query: torch.Tensor, dropout_p: float = 0.0) -> str | None:
    """The variable-length kernel that attends ``query``'s pack: ``"flash_attn"`` (flash-attn installed),
    ``"torch"`` (torch's ``varlen_attn``, no dropout), or None for the padded plan (not CUDA, not fp16/bf16, or a
    head size the flash kernels do not take)."""
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16):
        return None
    if query.shape[-1] % 8 or query.shape[-1] > 256:
        return None
    if _flash_attn_varlen() is not None:
        return "flash_attn"
    if _torch_varlen() is not None and dropout_p == 0.0:
        return "torch"
    return None


def _attend_varlen(kernel: str, plan: dict, query, key, value, scale, dropout_p: float, gqa: bool) -> torch.Tensor:
    """:func:`_varlen_plan`'s attention: one variable-length flash call, ``[tokens, heads, dim]`` in pack order."""
    q = _token_major(query, plan["q_index"]).contiguous()
    k, v = (_token_major(t, plan["k_index"]).contiguous() for t in (key, value))
    args = (q, k, v, plan["cu_q"], plan["cu_k"], plan["max_q"], plan["max_k"])
    if kernel == "flash_attn":  # causal=True aligns the mask to the bottom right (a row behind a prefix)
        out = _flash_attn_varlen()(*args, dropout_p=dropout_p, softmax_scale=scale, causal=True)
    else:  # window (-1, 0): causal, bottom-right aligned as flash-attn's
        out = _call_torch_varlen(args, scale, gqa)
    return out if plan["out_index"] is None else out.index_select(0, plan["out_index"])


def _call_torch_varlen(args: tuple, scale: float | None, gqa: bool) -> torch.Tensor:
    """torch's ``varlen_attn`` on ``args``, causal. Grouped-query attention (fewer key/value heads than query
    heads) goes through its ``enable_gqa`` where it has one (torch >= 2.12); on older torch the key and value heads
    are repeated to the query's count."""
    fn = _torch_varlen()
    q, k, v, *rest = args
    if gqa and k.shape[1] != q.shape[1]:
        if _takes_enable_gqa(fn):
            return fn(*args, scale=scale, window_size=(-1, 0), enable_gqa=True)
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return fn(q, k, v, *rest, scale=scale, window_size=(-1, 0))


@functools.cache
def _takes_enable_gqa(fn) -> bool:
    """Whether the attention function ``fn`` has an ``enable_gqa`` argument (looked up once per function)."""
    return "enable_gqa" in inspect.signature(fn).parameters


def _plan(layout: dict, kind: str, device: torch.device) -> dict:
    """The layout's plan of ``kind`` on ``device``, built by the first layer and kept in the layout for the others
    (and for the recomputation under gradient checkpointing)."""
    key = f"plan:{kind}:{device}"
    if key not in layout:
        layout[key] = (_varlen_plan if kind == "varlen" else _sets_plan)(layout, device)
    return layout[key]


def varlen_sdpa_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, rlflow_pack=None, **kwargs
):
    """Causal attention within each packed sequence (see the module docstring); ``rlflow_pack`` is the batch's
    :func:`attention_layout`. Returns ``[1, tokens, heads, dim]`` as transformers' attention functions do."""
    layout = rlflow_pack
    if layout is None:
        raise ValueError(f"the {ATTENTION_NAME} attention runs only in a packed forward (rlflow_pack=...)")
    dropout_p = dropout if module.training else 0.0
    gqa = query.shape[1] != key.shape[1]
    if "attn_full" in layout:  # equally long, nothing shared: a reshape, no gather, no mask
        seqs, width = layout["attn_full"].tolist()
        q, k, v = (t.squeeze(0).unflatten(1, (seqs, width)).transpose(0, 1) for t in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                                               dropout_p=dropout_p, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(1, -1, out.shape[1], out.shape[3]), None  # [1, tokens, heads, dim]
    kernel = varlen_kernel(query, dropout_p)
    if kernel is not None:
        out = _attend_varlen(kernel, _plan(layout, "varlen", query.device), query, key, value, scaling, dropout_p,
                             gqa)
    else:
        out = _attend_sets(_plan(layout, "sets", query.device), query, key, value, scaling, dropout_p, gqa)
    return out.unsqueeze(0), None  # [1, tokens, heads, dim]


AttentionInterface.register(ATTENTION_NAME, varlen_sdpa_attention)
