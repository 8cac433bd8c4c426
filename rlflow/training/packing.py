"""Padding-free training batches: sequences packed end to end into token budgets, attention kept per sequence.

A padded micro-batch of GRPO sequences wastes most of its tokens when lengths vary (every row is as long as
the longest prompt plus the longest completion). Here each experience's ``prompt + completion`` is laid end to
end in one row of at most ``pack_max_length`` tokens, with ``position_ids`` restarting at 0 for every sequence
and no attention mask. transformers reads such position ids as packed sequences: the sdpa/eager paths build a
block-diagonal causal mask from them (``masking_utils.find_packed_sequence_indices``) and the flash-attention
paths run variable-length kernels, so a token never attends across a sequence boundary. A micro-batch is one
pack, so micro-batches are sized by tokens, not by sequences.

With ``share_prompts`` (rlflow's own var-len attention, below) a group's prompt is laid once per pack, and a
prompt head common to every group of a pack (a chat template's head, a system prompt, an instruction: at least
:data:`MIN_SHARED_HEAD` tokens) once per pack: the groups' prompt tails attend to it, as the rollout engine's
shared prefix does.

Simplifications: packs are filled first-fit-decreasing by length (no reordering across mini-batches); a single
sequence longer than ``pack_max_length`` gets a pack of its own rather than an error; a pack is one row (batch
size 1), which is what the var-len kernels want; on sdpa the block-diagonal mask is dense (``tokens²``).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface

from rlflow.data.experience import Experience, completion_tensors, flat_tensor
from rlflow.training.logprobs import _has_logit_postprocessing, naive_token_stats, token_stats_from_hidden

ATTENTION_NAME = "rlflow_varlen_sdpa"
#: Fewest tokens of a prompt head common to the groups of a pack for it to be laid once per pack (shorter common
#: heads stay in each group's prompt: an extra attention row set costs more than it saves).
MIN_SHARED_HEAD = 16


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


def segment_layout(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rows_layout` of sequences of ``lengths`` laid end to end."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return rows_layout([list(range(s, s + n)) for s, n in zip(starts, lengths)])


#: Attention row sets of a pack: 0 queries = keys (a whole sequence, a shared prompt or head), 1 completions behind
#: a shared prompt (3: the longer half of them, see :data:`SPLIT_COMPLETION_ROWS`), 2 prompt tails behind a head.
ROW_SETS = (0, 1, 2, 3)
#: From this many completion rows on, those longer than the median go to a set of their own: each set is padded to
#: its longest row, and the CPU attention kernels' time follows the padded sizes (128 rows of 15-32 tokens: -22%).
SPLIT_COMPLETION_ROWS = 16


def attention_layout(rows: list[tuple[list[int], int, int]]) -> dict[str, torch.Tensor]:
    """The tensors :func:`varlen_sdpa_attention` needs, for attention rows ``(key positions, first query, set)``.

    Each row attends causally over its keys (flat token positions of the pack); its queries are its keys from
    index ``first query`` on, so a shared prompt can be one row of its own (queries = keys = the prompt) while
    each member's completion is another (queries = the completion, keys = prompt + completion). Every pack
    position must be a query of exactly one row. Rows are attended in sets (0 to 3), each padded to its own
    widths. Per set: ``attn{s}_q``/``attn{s}_k`` ``[rows, width]`` (positions, 0 past the end), ``attn{s}_mask``
    ``[rows, 1, q_width, k_width]`` (causal and key padding); over the sets: ``attn_q_all``/``attn_k_all`` (the
    sets' flattened ``attn{s}_q``/``attn{s}_k`` end to end) and ``attn_out``, each pack position's place in the
    sets' flattened ``[rows * q_width]`` outputs end to end. Equal-length rows laid end to end with nothing shared
    only get ``attn_full`` ``[rows, width]``: attention is then a reshape.
    """
    widths = {len(keys) for keys, _, _ in rows}
    if all(first == 0 for _, first, _ in rows) and len(widths) == 1:
        width = widths.pop()
        if [k for keys, _, _ in rows for k in keys] == list(range(len(rows) * width)):
            return {"attn_full": torch.tensor([len(rows), width])}
    layout: dict[str, torch.Tensor] = {}
    order, q_all, k_all, takes, offset = [], [], [], [], 0
    for s in sorted({row_set for _, _, row_set in rows}):
        if s not in ROW_SETS:
            raise ValueError(f"attention_layout: row set {s} is not one of {ROW_SETS}")
        group = [(keys, first) for keys, first, row_set in rows if row_set == s]
        k_index, k_valid = rows_layout([keys for keys, _ in group])
        q_index, q_valid = rows_layout([keys[first:] for keys, first in group])
        q_col = torch.tensor([first for _, first in group])[:, None] + torch.arange(q_index.shape[1])[None, :]
        mask = (torch.arange(k_index.shape[1])[None, None, :] <= q_col[:, :, None]) & k_valid[:, None, :]
        take = q_valid.reshape(-1).nonzero().squeeze(1)
        layout.update({f"attn{s}_q": q_index, f"attn{s}_k": k_index, f"attn{s}_mask": mask.unsqueeze(1)})
        order.append(q_index.reshape(-1)[take])
        q_all.append(q_index.reshape(-1))
        k_all.append(k_index.reshape(-1))
        takes.append(take + offset)
        offset += q_index.numel()
    positions = torch.cat(order)
    if positions.numel() != int(positions.max()) + 1 or torch.unique(positions).numel() != positions.numel():
        raise ValueError("attention_layout: every pack position must be the query of exactly one row")
    inv = torch.empty_like(positions)
    inv[positions] = torch.arange(positions.numel())
    # one gather per tensor for every set (its backward is one index_add_), and one back to pack order
    layout.update({"attn_q_all": torch.cat(q_all), "attn_k_all": torch.cat(k_all), "attn_out": torch.cat(takes)[inv]})
    return layout


def varlen_sdpa_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, rlflow_pack=None, **kwargs
):
    """Causal attention within each packed sequence, for implementations without a var-len kernel (CPU sdpa).

    For each row set of :func:`attention_layout` the packed ``[1, heads, tokens, dim]`` states are gathered into
    ``[rows, heads, width, dim]`` (queries and keys each at their own width), attended with the set's mask and
    the real queries gathered back, so attention costs ``sum(queries x keys)`` over the rows while every other
    layer runs on the packed tokens; a shared prompt's own attention is computed once, not once per member.
    """
    layout = rlflow_pack
    dropout_p = dropout if module.training else 0.0
    gqa = query.shape[1] != key.shape[1]
    if "attn_full" in layout:  # equally long, nothing shared: a reshape, no gather, no mask
        seqs, width = layout["attn_full"].tolist()
        q, k, v = (t.squeeze(0).unflatten(1, (seqs, width)).transpose(0, 1) for t in (query, key, value))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                                               dropout_p=dropout_p, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(1, -1, out.shape[1], out.shape[3]), None  # [1, tokens, heads, dim]
    sets = [s for s in ROW_SETS if f"attn{s}_q" in layout]
    # every set's queries (keys, values) in one index_select of the token-major [tokens, heads, dim] view (the
    # projections' own memory order): its backward is one index_add_ over whole token rows, 3-4x faster on a CPU
    # than over [heads, tokens, dim] (squeeze, not [0], whose backward would build a zero tensor per use)
    q_all = query.squeeze(0).transpose(0, 1).index_select(0, layout["attn_q_all"])
    k_all, v_all = (t.squeeze(0).transpose(0, 1).index_select(0, layout["attn_k_all"]) for t in (key, value))
    q_parts = q_all.split([layout[f"attn{s}_q"].numel() for s in sets])
    k_sizes = [layout[f"attn{s}_k"].numel() for s in sets]
    outs = []
    for s, q, k, v in zip(sets, q_parts, k_all.split(k_sizes), v_all.split(k_sizes)):
        q_shape, k_shape = layout[f"attn{s}_q"].shape, layout[f"attn{s}_k"].shape
        q, k, v = q.unflatten(0, q_shape).transpose(1, 2), *(t.unflatten(0, k_shape).transpose(1, 2) for t in (k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=layout[f"attn{s}_mask"], scale=scaling, dropout_p=dropout_p, enable_gqa=gqa)
        outs.append(out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3]))  # [rows * q_width, heads, dim]
    out = (torch.cat(outs) if len(outs) > 1 else outs[0]).index_select(0, layout["attn_out"])  # real queries, in order
    return out.unsqueeze(0), None  # [1, tokens, heads, dim]


AttentionInterface.register(ATTENTION_NAME, varlen_sdpa_attention)


def is_checkpointing(model: torch.nn.Module) -> bool:
    """Whether ``model``'s layers recompute their activations in the backward pass (transformers'
    ``is_activation_checkpointing``; ``is_gradient_checkpointing``, its deprecated name, before 5.x)."""
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    return bool(checkpointing)


def varlen_supported(model: torch.nn.Module) -> bool:
    """Whether packed forwards of ``model`` run :func:`varlen_sdpa_attention` (and so may share prompts)."""
    return getattr(model.config, "_attn_implementation", None) in ("sdpa", "eager") and not is_checkpointing(model)


@contextlib.contextmanager
def _varlen_attention(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
    """Run the model with :func:`varlen_sdpa_attention` where it helps; yields the extra forward kwargs.

    Used for ``sdpa``/``eager`` (whose packed-sequence path builds a dense ``tokens²`` mask); flash-attention
    implementations keep their own var-len kernels, and gradient checkpointing keeps the model's path (the
    recomputed forward would run after the implementation is restored).
    """
    config = model.config
    previous = getattr(config, "_attn_implementation", None)
    if not varlen_supported(model):
        if any(f"attn{s}_q" in batch for s in ROW_SETS[1:]):
            raise ValueError(
                "a pack with shared prompts needs rlflow's var-len attention (sdpa/eager, no gradient checkpointing)"
            )
        yield {}
        return
    config._attn_implementation = ATTENTION_NAME
    try:
        yield {"rlflow_pack": {k: v for k, v in batch.items() if k.startswith("attn")}}
    finally:
        config._attn_implementation = previous


def pack_indices(lengths: list[int], pack_max_length: int) -> list[list[int]]:
    """Group sequence indices into packs of at most ``pack_max_length`` tokens (first fit, longest first).

    A sequence longer than the budget is put in a pack of its own. Within a pack, indices keep their order.
    """
    if pack_max_length < 1:
        raise ValueError(f"pack_max_length must be >= 1, got {pack_max_length}")
    packs: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for p, free in enumerate(room):
            if lengths[i] <= free:
                packs[p].append(i)
                room[p] -= lengths[i]
                break
        else:
            packs.append([i])
            room.append(max(pack_max_length - lengths[i], 0))
    return [sorted(p) for p in packs]


def balance_pack_count(packs: list[list[Experience]], count: int) -> list[list[Experience]]:
    """Split packs until there are ``count`` of them (FSDP2 ranks must run the same number of forward passes).

    The pack with the most tokens among those of two or more sequences is halved (by sequences, keeping their
    order) each time; a split group simply gets its prompt in both halves. Splitting never changes a log-prob,
    only how many tokens one forward pass holds.
    """
    packs = [list(p) for p in packs]
    while len(packs) < count:
        splittable = [i for i, p in enumerate(packs) if len(p) > 1]
        if not splittable:
            raise ValueError(f"cannot split {len(packs)} packs of one sequence each into {count} micro-batches")
        i = max(splittable, key=lambda j: sum(len(e.prompt_ids) + len(e.completion_ids) for e in packs[j]))
        half = len(packs[i]) // 2
        packs[i: i + 1] = [packs[i][:half], packs[i][half:]]
    return packs


def prompt_units(experiences: list[Experience], pack_max_length: int, share_prompts: bool) -> list[list[int]]:
    """Indices of experiences laid out together behind one copy of their prompt (one each without sharing).

    Experiences share a prompt when they have the same ``group`` and the same prompt ids; a unit is cut where
    prompt + completions would exceed ``pack_max_length``.
    """
    if not share_prompts:
        return [[i] for i in range(len(experiences))]
    clusters: dict[tuple, list[int]] = {}
    for i, e in enumerate(experiences):
        clusters.setdefault((e.group, tuple(e.prompt_ids)), []).append(i)
    units = []
    for members in clusters.values():
        unit, size = [], len(experiences[members[0]].prompt_ids)
        for i in members:
            c = len(experiences[i].completion_ids)
            if unit and size + c > pack_max_length:
                units.append(unit)
                unit, size = [], len(experiences[i].prompt_ids)
            unit.append(i)
            size += c
        units.append(unit)
    return units


def shared_head_length(prompts: list[list[int]]) -> int:
    """Tokens of the prompt head common to ``prompts`` (one per prompt unit) laid once per pack: their common
    prefix where there are two prompts or more and it has at least :data:`MIN_SHARED_HEAD` tokens, else 0."""
    if len(prompts) < 2:
        return 0
    first, n = prompts[0], min(len(p) for p in prompts)
    for prompt in prompts[1:]:
        n = next((j for j in range(n) if prompt[j] != first[j]), n)
        if n < MIN_SHARED_HEAD:
            return 0
    return n


def pack_experiences(
    experiences: list[Experience], pack_max_length: int, share_prompts: bool = False
) -> list[list[Experience]]:
    """Split ``experiences`` into micro-batches of at most ``pack_max_length`` tokens (a group's members stay
    together when ``share_prompts``, their prompt counted once, and a prompt head common to every group counted
    once per pack, see :func:`shared_head_length`)."""
    units = prompt_units(experiences, pack_max_length, share_prompts)
    prompts = [experiences[u[0]].prompt_ids for u in units]
    head = shared_head_length(prompts) if share_prompts else 0
    if head >= pack_max_length:  # a head as long as the budget: packs without one
        head = 0
    # each pack's head (the common prefix of its own prompts) is at least this one, so a pack of two or more units
    # holds at most head + (pack_max_length - head) tokens; a unit alone is its whole prompt and completions
    lengths = [len(prompt) - head + sum(len(experiences[i].completion_ids) for i in u)
               for prompt, u in zip(prompts, units)]
    return [[experiences[i] for j in pack for i in units[j]] for pack in pack_indices(lengths, pack_max_length - head)]


def collate_packed(experiences: list[Experience], share_prompts: bool = False) -> dict[str, torch.Tensor]:
    """Lay ``experiences`` end to end in one row (with ``share_prompts``, a group's prompt once, then each
    member's completion, positions continuing from the prompt for every completion; and a prompt head common to
    every group, :func:`shared_head_length`, once at the start, each group's prompt tail attending to it).

    Returns ``input_ids``/``position_ids`` ``[1, tokens]``, ``logit_index`` (the position whose output predicts
    each completion token, in experience order), the attention layout of :func:`attention_layout` (``attn*``)
    and, as :func:`rlflow.data.experience.collate` does, ``completion_ids``/``completion_mask``/
    ``rollout_logprobs``/``old_logprobs``/``ref_logprobs`` of shape ``[sequences, completion_width]`` and
    ``advantages``/``truncated`` of shape ``[sequences]``.
    """
    units = prompt_units(experiences, 1 << 62, share_prompts)
    if any(not e.prompt_ids for e in experiences):
        raise ValueError("a packed sequence needs a non-empty prompt (its first completion token is predicted from it)")
    head = shared_head_length([experiences[u[0]].prompt_ids for u in units]) if share_prompts else 0
    ids: list[int] = list(experiences[units[0][0]].prompt_ids[:head])
    positions: list[int] = list(range(head))
    # attention rows: (key positions, index of the first query, row set of attention_layout)
    rows: list[tuple[list[int], int, int]] = [(list(range(head)), 0, 0)] if head else []
    logit_of: dict[int, list[int]] = {}
    for unit in units:
        prompt = experiences[unit[0]].prompt_ids
        p = len(prompt)
        shared = share_prompts and (len(unit) > 1 or head > 0)
        for k, i in enumerate(unit):
            e = experiences[i]
            if k == 0 or not share_prompts:
                prompt_start = len(ids)
                ids.extend(e.prompt_ids[head:])
                positions.extend(range(head, p))
                prompt_keys = list(range(head)) + list(range(prompt_start, prompt_start + p - head))
                if shared and p > head:  # the prompt's own attention (its tail's, behind a head), once for the group
                    rows.append((prompt_keys, head, 2 if head else 0))
            start = len(ids)
            c = len(e.completion_ids)
            ids.extend(e.completion_ids)
            positions.extend(range(p, p + c))
            keys = prompt_keys + list(range(start, start + c))
            if not shared:
                rows.append((keys, 0, 0))
            elif c:  # the completion's queries over the shared prompt and its own tokens
                rows.append((keys, p, 1))
            logit_of[i] = ([prompt_keys[-1]] + list(range(start, start + c - 1))) if c else []
    logit_index = [j for i in range(len(experiences)) for j in logit_of[i]]
    completions = [i for i, (keys, first, row_set) in enumerate(rows) if row_set == 1]
    if len(completions) >= SPLIT_COMPLETION_ROWS:  # the longer half attended apart: less padding in each set
        widths = sorted(len(rows[i][0]) - rows[i][1] for i in completions)
        median = widths[len(widths) // 2]
        for i in completions:
            keys, first, _ = rows[i]
            if len(keys) - first > median:
                rows[i] = (keys, first, 3)
    return {
        "input_ids": flat_tensor(ids, torch.long)[None],
        "position_ids": flat_tensor(positions, torch.long)[None],
        "logit_index": flat_tensor(logit_index, torch.long),
        **attention_layout(rows),
        **completion_tensors(experiences),
    }


def packed_completion_logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float = 1.0, chunk_size: int = 1024,
    sharded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies ``[sequences, completion_width]`` of a packed batch's completion tokens.

    Zero past each completion's end (``token_mask``), like the padded path's values there are ignored by the loss.
    ``sharded``: ``model`` is FSDP2-sharded, so the decoder runs through the root's forward
    (:func:`rlflow.training.distributed.root_hidden_states`), which unshards the embeddings and LM head.
    """
    from rlflow.training.distributed import reshard_root_without_grad, root_hidden_states

    mask = batch.get("token_mask", batch["completion_mask"])  # every completion token has a logit_index entry
    targets = batch["completion_ids"][mask]
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "attention_mask": None}
    lm_head = model.get_output_embeddings()
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    def rows(states: torch.Tensor) -> torch.Tensor:  # index_select: its backward is ~3x faster than indexing's
        return states.squeeze(0).index_select(0, batch["logit_index"])

    with _varlen_attention(model, batch) as extra:
        if lm_head is None or base is None or _has_logit_postprocessing(model):
            hidden = None
            logits = rows(model(**inputs, use_cache=False, **extra).logits)
        elif sharded:
            hidden = rows(root_hidden_states(model, {**inputs, **extra}))
        else:
            hidden = rows(base(**inputs, use_cache=False, **extra).last_hidden_state)
    if hidden is None:
        flat_lp, flat_ent = naive_token_stats(logits, targets, temperature)
    else:
        flat_lp, flat_ent = token_stats_from_hidden(hidden, targets, lm_head, temperature, chunk_size)
    if sharded:
        reshard_root_without_grad(model)
    logprobs = flat_lp.new_zeros(mask.shape).masked_scatter(mask, flat_lp)
    entropy = flat_ent.new_zeros(mask.shape).masked_scatter(mask, flat_ent)
    return logprobs, entropy
