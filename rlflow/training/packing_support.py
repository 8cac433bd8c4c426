"""Whether packed micro-batches (:mod:`rlflow.training.packing`) are exact for a model: a check, then a probe.

Why a probe: packing relies on the model's forward honouring restarting ``position_ids`` as sequence boundaries.
With ``sdpa``/``eager`` attention rlflow swaps in its own packed attention (:mod:`rlflow.training.pack_attention`),
which needs the attention to go through transformers' attention interface with extra keyword arguments passed down;
with flash-attention transformers' own packed-sequence detection must see the position ids. Neither can be
read from a config, so three tiny sequences (two sharing a prompt) are scored packed and padded and compared:
it costs two forward passes of ~20 tokens, once per run.

The tolerance follows the dtype the forward computes in, read off its first linear projection's output: FSDP2's
``param_dtype: bfloat16`` and autocast compute in bf16 while the stored parameters stay float32. On an H100 the
Qwen3-0.6B shape's packed and padded bf16 log-probs differ by 0.0078 (different attention kernels, each rounding in
bf16), which a float32 tolerance would misread as sequences leaking into each other. A real model's log-probs of
the probe's random tokens lie around -15, where bf16 rounds by more than the fixed 16-bit tolerance in any layout:
there the gap is set against the model's own rounding between two padded layouts, and each sequence must keep its
log-probs when the pack's order is reversed (:func:`probe_error`).

Simplifications: a probe, not a proof; the 16-bit tolerance is loose (the two layouts round differently).
"""

from __future__ import annotations

from typing import Any

import torch

from rlflow.data.experience import Experience, collate
from rlflow.training.packing import collate_packed, packed_completion_logprobs, varlen_supported

TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-6}  # max |packed - padded| log-prob; 16-bit dtypes: 0.1
HALF_TOLERANCE = 0.1
ORDER_TOLERANCE = 0.01  # 16 bits: how far a sequence's packed log-probs may move when the pack's order is reversed
HALF_LAYOUT_BOUND = 0.5  # 16 bits, where two padded layouts agree to the bit: the largest gap a pack may show


def static_unsupported_reason(model: Any) -> str | None:
    """What in ``model``'s configuration rlflow's packing does not implement (sliding windows, images), or None."""
    config = model.config
    from rlflow.models.vision import PACKING_REASON, is_vision_config

    if is_vision_config(config):
        return PACKING_REASON.format(name=type(model).__name__)
    types = set(getattr(config, "layer_types", None) or [])
    sliding = (types and types != {"full_attention"}) or (not types and getattr(config, "sliding_window", None))
    if sliding and varlen_supported(model):
        return "rlflow's packed attention is full causal attention, and this model has sliding-window or hybrid layers"
    return None


def probe_experiences(vocab_size: int) -> list[Experience]:
    """Two completions of one prompt and one of another, of different lengths (fixed pseudo-random ids)."""
    gen = torch.Generator().manual_seed(4321)
    ids = torch.randint(0, vocab_size, (20,), generator=gen, device="cpu").tolist()
    made = [(ids[:5], ids[5:9], 0), (ids[:5], ids[9:11], 0), (ids[11:14], ids[14:20], 1)]
    return [Experience(p, c, [0.0] * len(c), 0.0, 0.0, g, "stop", 0) for p, c, g in made]


def _rows(logprobs: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Each sequence's completion log-probs (float32) of a ``[sequences, width]`` result."""
    return [logprobs[i][mask[i]].float() for i in range(len(mask))]


def _gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


@torch.no_grad()
def probe_error(model: Any, sharded: bool = False) -> str | None:
    """None if ``model``'s packed log-probs equal its padded ones on :func:`probe_experiences`, else why not.

    In 16 bits a real model's log-probs of the probe's random tokens (around -15) round by more than the fixed
    16-bit tolerance in any layout (SmolLM2-135M in bf16: 0.09-0.11 between the padded batch and each sequence
    scored alone). There a larger gap passes when each sequence's packed log-probs stay within 0.01 when the pack's
    order is reversed (a sequence that attended to another, or whose positions did not restart, would move by far
    more) and the gap is within three times that gap between two padded layouts, or, where the CPU's 16-bit
    kernels give each row the same bits in any batch (that gap is then 0, and measures nothing: an AVX512-BF16
    Xeon), at most :data:`HALF_LAYOUT_BOUND` (0.5): a pack's short rows are attended in float32 and the padded
    batch in bf16 (SmolLM2-135M with bf16 weights there: 0.23 apart, 0 when the pack is reversed).

    ``sharded``: ``model`` is FSDP2-sharded; every rank must call this (the forwards are collectives).
    """
    from rlflow.training.distributed import sharded_completion_logprobs
    from rlflow.training.logprobs import completion_logprobs

    device = next(model.parameters()).device
    exps = probe_experiences(model.get_input_embeddings().num_embeddings)
    score = sharded_completion_logprobs if sharded else completion_logprobs

    def padded(batch_exps):
        batch = {k: v.to(device) for k, v in collate(batch_exps, pad_id=0).items()}
        return _rows(score(model, batch)[0], batch["completion_mask"])

    def packed(batch_exps):
        batch = {k: v.to(device) for k, v in collate_packed(batch_exps, share_prompts=varlen_supported(model)).items()}
        return _rows(packed_completion_logprobs(model, batch, sharded=sharded)[0],
                     collate(batch_exps, pad_id=0)["completion_mask"].to(device))

    was_training = model.training
    model.eval()
    computed = []  # what the forward computes in (FSDP2's param_dtype, autocast): a projection's output dtype
    linear = next((m for m in model.modules() if isinstance(m, torch.nn.Linear)), None)
    hook = linear.register_forward_hook(lambda m, i, out: computed.append(out.dtype)) if linear is not None else None
    try:
        in_order, padded_in_order = packed(exps), padded(exps)
        worst = _gap(in_order, padded_in_order)
        dtype = computed[0] if computed else next(model.parameters()).dtype
        tolerance = TOLERANCE.get(dtype, HALF_TOLERANCE)
        name = str(dtype).removeprefix("torch.")
        if worst <= tolerance:
            return None
        if dtype not in TOLERANCE:  # 16 bits: the model's own rounding, and whether order moves a sequence
            moved = _gap(packed(exps[::-1])[::-1], in_order)
            if moved > ORDER_TOLERANCE:
                return (f"a sequence's packed log-probs move by {moved:.3g} when the pack's order is reversed (> "
                        f"{ORDER_TOLERANCE:g} in {name}): sequences leak into each other")
            rounding = _gap(padded_in_order, [padded([e])[0] for e in exps])
            if worst <= 3 * rounding or (rounding == 0 and worst <= HALF_LAYOUT_BOUND):
                return None
            bound = f"> 3x the {rounding:.3g} between two padded layouts" if rounding else \
                f"> {HALF_LAYOUT_BOUND:g} where two padded layouts agree to the bit"
            return (f"packed log-probs differ from padded ones by {worst:.3g} (> {tolerance:g}, and {bound}, in "
                    f"{name}): sequences leak into each other")
    except Exception as exc:  # a forward that cannot take a packed batch: not this model
        return f"a packed forward of this model fails ({type(exc).__name__}: {exc})"
    finally:
        model.train(was_training)
        if hook is not None:
            hook.remove()
    return f"packed log-probs differ from padded ones by {worst:.3g} (> {tolerance:g} in {name}): sequences leak " \
        "into each other"


def packing_unsupported_reason(model: Any, sharded: bool = False) -> str | None:
    """Why packed micro-batches would be wrong for ``model`` (None: they are exact)."""
    return static_unsupported_reason(model) or probe_error(model, sharded)


def resolve_packing(configured: bool, models: list[Any], sharded: bool, pack_max_length: int) -> bool:
    """Whether micro-batches are packs: ``configured`` (``model.update.packing``), unless packed forwards of one of
    ``models`` (the policy, then the reference if any; None entries are skipped) would not be exact: then padded
    micro-batches, with a warning giving the reason. The choice is logged once, on rank 0.

    ``sharded``: the models are FSDP2-sharded; every rank must call this (the probe's forwards are collectives).
    """
    from rlflow.log import info, warn

    if not configured:
        return False
    models = [m for m in models if m is not None]
    reason = next((r for r in (packing_unsupported_reason(m, sharded) for m in models) if r), None)
    if reason:
        warn(
            f"model.update.packing: training on padded micro-batches of model.update.micro_batch_size sequences, "
            f"not packs, because {reason}"
        )
        return False
    share = "a group's prompt once per pack" if varlen_supported(models[0]) else "every sequence its own prompt"
    info(f"model.update.packing: micro-batches are packs of at most {pack_max_length} tokens ({share})")
    return True
