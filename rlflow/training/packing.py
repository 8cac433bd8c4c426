"""Padding-free training batches: sequences packed end to end into token budgets, attention kept per sequence.

A padded micro-batch of GRPO sequences wastes most of its tokens when lengths vary (every row is as long as
the longest prompt plus the longest completion). Here each experience's ``prompt + completion`` is laid end to
end in one row of at most ``pack_max_length`` tokens, with ``position_ids`` restarting at 0 for every sequence
and no attention mask. A micro-batch is one pack, so micro-batches are sized by tokens, not by sequences.

Attention stays within each sequence. For ``sdpa``/``eager`` models rlflow swaps in its own packed attention
(:mod:`rlflow.training.pack_attention`, registered as ``rlflow_varlen_sdpa``), whose memory is linear in the
pack's tokens: per-sequence causal kernels on a CPU, one variable-length flash call on a GPU, and never the dense
``tokens x tokens`` block-diagonal mask that transformers' own sdpa/eager paths build from packed position ids
(``masking_utils.find_packed_sequence_indices``). It runs under gradient checkpointing too (the recomputation in
the backward pass attends the same way). flash-attention implementations keep transformers' variable-length path.

With ``share_prompts`` (rlflow's packed attention only) a group's prompt is laid once per pack, and a
prompt head common to every group of a pack (a chat template's head, a system prompt, an instruction: at least
:data:`MIN_SHARED_HEAD` tokens) once per pack: the groups' prompt tails attend to it, as the rollout engine's
shared prefix does.

Simplifications: packs are filled first-fit-decreasing by length (no reordering across mini-batches); a single
sequence longer than ``pack_max_length`` gets a pack of its own rather than an error; a pack is one row (batch
size 1), which is what the var-len kernels want.
"""

from __future__ import annotations

import contextlib

import torch

from rlflow.data.experience import Experience, completion_tensors, flat_tensor
from rlflow.training.logprobs import _has_logit_postprocessing, naive_token_stats, token_stats_from_hidden
from rlflow.training.pack_attention import ATTENTION_NAME, attention_layout, rows_layout

#: Fewest tokens of a prompt head common to the groups of a pack for it to be laid once per pack (shorter common
#: heads stay in each group's prompt: an extra attention row set costs more than it saves).
MIN_SHARED_HEAD = 16
#: From this many completion rows on, those longer than the median go to a set of their own: each set is padded to
#: its longest row, and the CPU attention kernels' time follows the padded sizes (128 rows of 15-32 tokens: -22%).
SPLIT_COMPLETION_ROWS = 16


def segment_layout(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rows_layout` of sequences of ``lengths`` laid end to end."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return rows_layout([list(range(s, s + n)) for s, n in zip(starts, lengths)])


def is_checkpointing(model: torch.nn.Module) -> bool:
    """Whether ``model``'s layers recompute their activations in the backward pass (transformers'
    ``is_activation_checkpointing``; ``is_gradient_checkpointing``, its deprecated name, before 5.x)."""
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    return bool(checkpointing)


def varlen_supported(model: torch.nn.Module) -> bool:
    """Whether packed forwards of ``model`` run :func:`~rlflow.training.pack_attention.varlen_sdpa_attention`
    (and so may share prompts): ``sdpa`` and ``eager`` models, with or without gradient checkpointing."""
    return getattr(model.config, "_attn_implementation", None) in ("sdpa", "eager")


def _checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules that run their forward through a gradient-checkpointing function (transformers'
    ``_gradient_checkpointing_func``, set on each checkpointed layer when checkpointing is on)."""
    return [m for m in model.modules() if getattr(m, "gradient_checkpointing", False)
            and callable(getattr(m, "_gradient_checkpointing_func", None))]


def _recomputed_under(checkpoint, config, implementation: str):
    """``checkpoint`` (a layer's checkpointing function) whose checkpointed function runs with ``config``'s
    attention implementation set to ``implementation``: in the forward and again when the backward pass recomputes
    it, after :func:`_varlen_attention` has restored the model's own implementation."""

    def checkpointed(function, *args, **kwargs):
        def under_implementation(*inner_args, **inner_kwargs):
            previous = config._attn_implementation
            config._attn_implementation = implementation
            try:
                return function(*inner_args, **inner_kwargs)
            finally:
                config._attn_implementation = previous

        return checkpoint(under_implementation, *args, **kwargs)

    return checkpointed


@contextlib.contextmanager
def _varlen_attention(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
    """Run the model with rlflow's packed attention where it applies; yields the extra forward kwargs.

    Used for ``sdpa``/``eager``, whose own packed-sequence path builds a dense ``tokens x tokens`` mask:
    transformers builds no mask for an attention implementation it does not know, and the layers call
    :func:`~rlflow.training.pack_attention.varlen_sdpa_attention` with the pack's layout. Under gradient
    checkpointing the layers' checkpointing functions are wrapped for the forward so that the recomputation in the
    backward pass (which runs after this context has restored the model's implementation) attends the same way.
    flash-attention implementations keep their own var-len kernels (plain packs only).
    """
    config = model.config
    previous = getattr(config, "_attn_implementation", None)
    if not varlen_supported(model):
        if "attn_rows" in batch and bool(batch["attn_rows"][:, 0].any()):
            raise ValueError("a pack with shared prompts needs rlflow's packed attention (sdpa/eager models)")
        yield {}
        return
    layers = [(layer, layer._gradient_checkpointing_func) for layer in _checkpointed_layers(model)]
    config._attn_implementation = ATTENTION_NAME
    for layer, checkpoint in layers:
        layer._gradient_checkpointing_func = _recomputed_under(checkpoint, config, ATTENTION_NAME)
    try:
        yield {"rlflow_pack": {k: v for k, v in batch.items() if k.startswith("attn")}}
    finally:
        for layer, checkpoint in layers:
            layer._gradient_checkpointing_func = checkpoint
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
