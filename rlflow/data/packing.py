"""Padding-free training batches: sequences packed end to end into token budgets, attention kept per sequence.

A padded micro-batch of GRPO sequences wastes most of its tokens when lengths vary (every row is as long as
the longest prompt plus the longest completion). Here each experience's ``prompt + completion`` is laid end to
end in one row of at most ``pack_max_length`` tokens, with ``position_ids`` restarting at 0 for every sequence
and no attention mask. transformers reads such position ids as packed sequences: the sdpa/eager paths build a
block-diagonal causal mask from them (``masking_utils.find_packed_sequence_indices``) and the flash-attention
paths run variable-length kernels, so a token never attends across a sequence boundary. A micro-batch is one
pack, so micro-batches are sized by tokens, not by sequences.

Simplifications: packs are filled first-fit-decreasing by length (no reordering across mini-batches); a single
sequence longer than ``pack_max_length`` gets a pack of its own rather than an error; a pack is one row (batch
size 1), which is what the var-len kernels want; on sdpa the block-diagonal mask is dense (``tokens²``).
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface

from rlflow.data.experience import Experience, completion_tensors
from rlflow.logprobs import _has_logit_postprocessing, naive_token_stats, token_stats_from_hidden

ATTENTION_NAME = "rlflow_varlen_sdpa"


def rows_layout(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``index`` ``[sequences, longest]``: each attention row's flat token positions (0 past its end), and
    ``valid``, the real entries."""
    width = max(len(r) for r in rows)
    index = torch.zeros((len(rows), width), dtype=torch.long)
    valid = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        index[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        valid[i, : len(r)] = True
    return index, valid


def segment_layout(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rows_layout` of sequences of ``lengths`` laid end to end."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return rows_layout([list(range(s, s + n)) for s, n in zip(starts, lengths)])


def varlen_sdpa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, rlflow_pack=None, **kwargs):
    """Causal attention within each packed sequence, for implementations without a var-len kernel (CPU sdpa).

    The packed ``[1, heads, tokens, dim]`` states are gathered into ``[sequences, heads, longest, dim]``, attended
    with a causal + key-padding mask and scattered back, so the cost is that of a padded batch for attention
    only (``sum(len²)``, not ``tokens²``) while every other layer runs on the packed tokens.
    """
    index, valid, owned = rlflow_pack
    seqs, width = index.shape
    full = owned is None and seqs * width == query.shape[2]  # equally long, nothing shared: a reshape, no gather
    if full:
        q, k, v = (t[0].unflatten(1, (seqs, width)).transpose(0, 1) for t in (query, key, value))
    else:
        flat = index.reshape(-1)  # index_select: its backward is index_add_, cheaper than advanced indexing's
        q, k, v = (t[0].index_select(1, flat).unflatten(1, index.shape).transpose(0, 1) for t in (query, key, value))
    mask = None
    if not full:
        causal = torch.ones((width, width), dtype=torch.bool, device=q.device).tril()
        mask = causal[None, None] & valid[:, None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=full, scale=scaling, dropout_p=dropout if module.training else 0.0,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    out = out.transpose(1, 2)  # [seqs, longest, heads, dim]
    if full:
        return out.reshape(1, -1, *out.shape[2:]), None  # [1, tokens, heads, dim]
    return out[valid if owned is None else owned].unsqueeze(0), None


AttentionInterface.register(ATTENTION_NAME, varlen_sdpa_attention)


def varlen_supported(model: torch.nn.Module) -> bool:
    """Whether packed forwards of ``model`` run :func:`varlen_sdpa_attention` (and so may share prompts)."""
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    return getattr(model.config, "_attn_implementation", None) in ("sdpa", "eager") and not checkpointing


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
        if batch.get("seq_owned") is not None:
            raise ValueError("a pack with shared prompts needs rlflow's var-len attention (sdpa/eager, no gradient checkpointing)")
        yield {}
        return
    config._attn_implementation = ATTENTION_NAME
    try:
        yield {"rlflow_pack": (batch["seq_index"], batch["seq_valid"], batch.get("seq_owned"))}
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


def pack_experiences(experiences: list[Experience], pack_max_length: int, share_prompts: bool = False) -> list[list[Experience]]:
    """Split ``experiences`` into micro-batches of at most ``pack_max_length`` tokens (a group's members stay
    together when ``share_prompts``, their prompt counted once)."""
    units = prompt_units(experiences, pack_max_length, share_prompts)
    lengths = [len(experiences[u[0]].prompt_ids) + sum(len(experiences[i].completion_ids) for i in u) for u in units]
    return [[experiences[i] for j in pack for i in units[j]] for pack in pack_indices(lengths, pack_max_length)]


def collate_packed(experiences: list[Experience], share_prompts: bool = False) -> dict[str, torch.Tensor]:
    """Lay ``experiences`` end to end in one row (with ``share_prompts``, a group's prompt once, then each
    member's completion, positions continuing from the prompt for every completion).

    Returns ``input_ids``/``position_ids`` ``[1, tokens]``, ``logit_index`` (the position whose output predicts
    each completion token, in experience order), the attention layout (``seq_index``/``seq_valid``: each
    sequence's token positions; ``seq_owned``: which of them a row writes back, only when prompts are shared)
    and, as :func:`rlflow.data.experience.collate` does, ``completion_ids``/``completion_mask``/
    ``rollout_logprobs``/``old_logprobs``/``ref_logprobs`` of shape ``[sequences, completion_width]`` and
    ``advantages``/``truncated`` of shape ``[sequences]``.
    """
    ids: list[int] = []
    positions: list[int] = []
    rows: list[list[int]] = []
    owned_prefix: list[int] = []  # per attention row: how many leading entries belong to another row
    logit_of: dict[int, list[int]] = {}
    for unit in prompt_units(experiences, 1 << 62, share_prompts):
        prompt = experiences[unit[0]].prompt_ids
        p = len(prompt)
        if p == 0:
            raise ValueError("a packed sequence needs a non-empty prompt (its first completion token is predicted from it)")
        for k, i in enumerate(unit):
            e = experiences[i]
            if k == 0 or not share_prompts:
                prompt_start = len(ids)
                ids.extend(e.prompt_ids)
                positions.extend(range(p))
            start = len(ids)
            c = len(e.completion_ids)
            ids.extend(e.completion_ids)
            positions.extend(range(p, p + c))
            rows.append(list(range(prompt_start, prompt_start + p)) + list(range(start, start + c)))
            owned_prefix.append(p if k > 0 and share_prompts else 0)
            logit_of[i] = ([prompt_start + p - 1] + list(range(start, start + c - 1))) if c else []
    logit_index = [j for i in range(len(experiences)) for j in logit_of[i]]
    seq_index, seq_valid = rows_layout(rows)
    batch = {
        "input_ids": torch.tensor([ids], dtype=torch.long),
        "seq_index": seq_index,
        "seq_valid": seq_valid,
        "position_ids": torch.tensor([positions], dtype=torch.long),
        "logit_index": torch.tensor(logit_index, dtype=torch.long),
        **completion_tensors(experiences),
    }
    if any(owned_prefix):
        cols = torch.arange(seq_index.shape[1])
        batch["seq_owned"] = seq_valid & (cols[None, :] >= torch.tensor(owned_prefix)[:, None])
    return batch


def packed_completion_logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float = 1.0, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies ``[sequences, completion_width]`` of a packed batch's completion tokens.

    Zero where ``completion_mask`` is false, like the padded path's values there are ignored by the loss.
    """
    mask = batch["completion_mask"]
    targets = batch["completion_ids"][mask]
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "attention_mask": None}
    lm_head = model.get_output_embeddings()
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    with _varlen_attention(model, batch) as extra:
        if lm_head is None or base is None or _has_logit_postprocessing(model):
            hidden = None
            logits = model(**inputs, use_cache=False, **extra).logits[0, batch["logit_index"]]
        else:
            hidden = base(**inputs, use_cache=False, **extra).last_hidden_state[0, batch["logit_index"]]
    if hidden is None:
        flat_lp, flat_ent = naive_token_stats(logits, targets, temperature)
    else:
        flat_lp, flat_ent = token_stats_from_hidden(hidden, targets, lm_head, temperature, chunk_size)
    logprobs = flat_lp.new_zeros(mask.shape).masked_scatter(mask, flat_lp)
    entropy = flat_ent.new_zeros(mask.shape).masked_scatter(mask, flat_ent)
    return logprobs, entropy
