"""Per-token log-probs and entropy of completion tokens, without the whole ``[tokens, vocab]`` logits tensor.

The decoder runs once to its last hidden state; the LM head is then applied to ``chunk_size`` positions at a
time, each chunk's logits turned into the log-prob of the taken token and the entropy and dropped. The float32
work on a chunk's logits (cast, log-softmax, probabilities, entropy; in the backward pass the logits' gradient)
runs on a CPU a block of rows at a time (:data:`BLOCK_BYTES`), so it stays in the cores' caches. Under autograd
the backward pass takes the logits of the first chunks kept from the forward (:data:`KEEP_LOGITS_BYTES` in all)
and recomputes the others; its gradient is written out by hand (so the peak holds the kept logits, a chunk's
logits and their gradient instead of every position's, and fewer than generic activation checkpointing would
keep). Under autocast (``trainer.precision: bf16-mixed``) the LM head's products run in the autocast dtype, in
forward and in the recomputing backward alike, while the log-softmax, the taken log-prob and the entropy are
float32; an :class:`~rlflow.models.lm_head.FP32Linear` head (``model.policy.cast_lm_head_to_fp32``) runs its
products in float32 instead. Simplification: the LM head is applied as the model's output embedding layer alone,
so models with a final logit soft-cap or scale fall back to the model's own logits.
"""

from __future__ import annotations

import contextlib

import torch

from rlflow.models.lm_head import is_fp32_head, no_autocast


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype] | None:
    """Whether autocast is on for ``device_type`` and its dtype (None where autocast does not exist)."""
    if not torch.amp.is_autocast_available(device_type):
        return None
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def _autocast(device_type: str, state: tuple[bool, torch.dtype] | None):
    """Re-enter an autocast state recorded by :func:`_autocast_state` (a no-op for None)."""
    if state is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type, dtype=state[1], enabled=state[0])


#: Bytes of logits (in the products' dtype) a training forward keeps for its backward pass, in all: the first chunks'
#: logits up to this are kept, and the backward pass takes them instead of computing the LM head's product again;
#: chunks past it are recomputed. Memory stays bounded by this plus a chunk.
KEEP_LOGITS_BYTES = 1 << 28
#: Bytes of float32 logits turned into statistics at a time on a CPU: a chunk's logits are handled a block of rows
#: at a time so the float32 copies, log-softmax, probabilities and their products stay in the cores' caches instead
#: of streaming the whole ``[chunk, vocab]`` tensor through memory once per operation. On accelerators a chunk is
#: one block (there, each operation is a kernel launch, and a launch per few rows would cost more than it saves).
BLOCK_BYTES = 1 << 21


def _block_rows(logits: torch.Tensor) -> int:
    """Rows of ``logits`` (``[rows, vocab]``) handled at a time: :data:`BLOCK_BYTES` of float32 logits (at least
    one row) on a CPU, every row elsewhere."""
    if logits.device.type != "cpu":
        return max(1, logits.shape[0])
    return max(1, BLOCK_BYTES // (4 * logits.shape[-1]))


def _entropy_into(p: torch.Tensor, logp: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``-sum(p * logp)`` of each row into ``out`` (float32: the products and sum are elementwise ops, which
    autocast leaves alone)."""
    return torch.sum(torch.mul(p, logp), -1, out=out).neg_()


def _block_logp(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Float32 log-softmax of a block of logits at ``temperature``."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    return torch.log_softmax(z, dim=-1)


def _stats_from_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float):
    """Taken-token log-prob and entropy (float32) of each row of ``logits`` (any float dtype), a block of rows at a
    time (:data:`BLOCK_BYTES`)."""
    rows = logits.shape[0]
    taken = torch.empty(rows, dtype=torch.float32, device=logits.device)
    entropy = torch.empty_like(taken)
    step = _block_rows(logits)
    for s in range(0, rows, step):
        logp = _block_logp(logits[s : s + step], temperature)
        taken[s : s + step] = logp.gather(-1, targets[s : s + step].unsqueeze(-1)).squeeze(-1)
        _entropy_into(logp.exp(), logp, entropy[s : s + step])
    return taken, entropy


def _chunked_stats(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias, temperature: float,
                   chunk_size: int, kept: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position's statistics, ``chunk_size`` positions at a time, never under autograd (the autograd path is
    :class:`_ChunkedTokenStats`). The weight is cast to the products' dtype once, not once per chunk. With
    ``kept`` (a list), each chunk's logits are appended to it while they fit :data:`KEEP_LOGITS_BYTES` in all,
    None past that."""
    weight = weight.to(_product_dtype(weight))
    outs, budget = [], KEEP_LOGITS_BYTES
    for s in range(0, targets.numel(), chunk_size):
        logits = torch.nn.functional.linear(hidden[s : s + chunk_size], weight, bias)
        outs.append(_stats_from_logits(logits, targets[s : s + chunk_size], temperature))
        if kept is not None:
            size = logits.numel() * logits.element_size()
            keep = size <= budget
            kept.append(logits if keep else None)
            budget = budget - size if keep else 0  # once a chunk is past the budget, so are the rest
        del logits
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


def _product_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the LM head's products run in: autocast's where it is on for the weight's device, else the
    weight's own."""
    state = _autocast_state(weight.device.type)
    if state is not None and state[0] and weight.is_floating_point():
        return state[1]
    return weight.dtype


def _grad_logits(z, targets, g_lp, g_ent, temperature: float, dtype: torch.dtype, grad_bias=None) -> torch.Tensor:
    """The gradient of a chunk's logits ``z`` in ``dtype``, from the closed forms ``d logp_t / dz = onehot(t) - p``
    and ``d H / dz = -p * (logp + H)`` (``g_ent`` None: no entropy term), a block of rows at a time; each block's
    float32 gradient summed over rows into ``grad_bias`` where given (the LM head's bias)."""
    grad = torch.empty(z.shape, dtype=dtype, device=z.device)
    step = _block_rows(z)
    for s in range(0, z.shape[0], step):
        logp = _block_logp(z[s : s + step], temperature)
        p = logp.exp()
        g = g_lp[s : s + step].unsqueeze(-1)
        if g_ent is None:
            grad_z = p.mul_(g).neg_()
        else:  # g_lp - g_ent * (logp + H), then times -p, in logp's and p's storage
            entropy = _entropy_into(p, logp, torch.empty(p.shape[0], dtype=p.dtype, device=p.device))
            logp.add_(entropy.unsqueeze(-1)).mul_(g_ent[s : s + step].unsqueeze(-1)).add_(g)
            grad_z = p.mul_(logp).neg_()
        grad_z.scatter_add_(-1, targets[s : s + step].unsqueeze(-1), g)
        if temperature != 1.0:
            grad_z.div_(temperature)
        if grad_bias is not None:
            grad_bias += grad_z.sum(0)
        grad[s : s + step] = grad_z
    return grad


class _ChunkedTokenStats(torch.autograd.Function):
    """LM head + log-softmax + taken log-prob + entropy, chunk by chunk, with a hand-written backward.

    Forward keeps the inputs and the first chunks' logits (:data:`KEEP_LOGITS_BYTES` in all); backward recomputes
    the other chunks' logits and forms every chunk's gradient from the closed forms (:func:`_grad_logits`) a block
    of rows at a time, so besides the kept logits and a few cache-sized blocks a chunk holds its logits and their
    gradient, in the products' dtype (generic activation checkpointing holds four to six float32 ``[chunk, vocab]``
    tensors there). An output the loss does not use gets no gradient term (the entropy, when no entropy bonus is
    trained).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size):
        ctx.kept = []  # intermediate tensors, not inputs or outputs: kept on ctx, as autograd's docs allow
        taken, entropy = _chunked_stats(hidden, targets, weight, bias, temperature, chunk_size, ctx.kept)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.autocast = _autocast_state(hidden.device.type)  # backward recomputes the logits under the same state
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None (no zero tensor, no term)
        return taken, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        with _autocast(ctx.saved_tensors[0].device.type, ctx.autocast):
            return _ChunkedTokenStats._backward(ctx, grad_logp, grad_entropy)

    @staticmethod
    def _backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        temperature, chunk = ctx.temperature, ctx.chunk_size
        dtype = _product_dtype(weight)
        product_weight = weight.to(dtype)  # cast once, where autocast would cast it for every product
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = None  # float32; the first chunk's product is it, later ones are added
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        kept = ctx.kept  # each entry is dropped once used: a second backward pass (retain_graph) recomputes
        for i, s in enumerate(range(0, targets.numel(), chunk)):
            h, t = hidden[s : s + chunk], targets[s : s + chunk]
            rows = t.numel()
            g_lp = grad_logp[s : s + chunk].float() if grad_logp is not None else h.new_zeros(rows, dtype=torch.float32)
            g_ent = grad_entropy[s : s + chunk].float() if grad_entropy is not None else None
            z = kept[i] if kept[i] is not None else torch.nn.functional.linear(h, product_weight, bias)
            kept[i] = None  # freed as soon as its gradient is formed
            gz = _grad_logits(z, t, g_lp, g_ent, temperature, dtype, grad_b)
            del z
            if need_h:
                grad_h[s : s + chunk] = gz @ product_weight
            if need_w:
                part = (gz.t() @ h.to(dtype)).float()
                grad_w = part if grad_w is None else grad_w.add_(part)
            del gz
        return (
            grad_h,
            grad_w.to(weight.dtype) if need_w else None,
            grad_b.to(bias.dtype) if need_b else None,
            None,
            None,
            None,
        )


def token_stats_from_hidden(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    lm_head: torch.nn.Module,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` and entropies from ``hidden`` (``[..., H]``) through ``lm_head``, chunk by chunk."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    shape = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    if flat_t.numel() == 0:
        empty = flat_h.new_zeros(0, dtype=torch.float32)
        return empty.view(shape), empty.view(shape)
    precision = contextlib.nullcontext()
    if is_fp32_head(lm_head):  # model.policy.cast_lm_head_to_fp32: the product in float32, autocast or not
        flat_h, weight = flat_h.float(), weight.float()
        bias = None if bias is None else bias.float()
        precision = no_autocast(flat_h.device.type)
    needs_grad = any(x is not None and x.requires_grad for x in (flat_h, weight, bias))
    with precision:
        if torch.is_grad_enabled() and needs_grad:
            lp, ent = _ChunkedTokenStats.apply(flat_h, weight, bias, flat_t, temperature, chunk_size)
        else:
            lp, ent = _chunked_stats(flat_h, flat_t, weight, bias, temperature, chunk_size)
    return lp.view(shape), ent.view(shape)


def naive_token_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same statistics from full logits (the fallback path, and the reference the chunked path is checked
    against)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    taken = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    p = logp.exp()
    with no_autocast(p.device.type):  # a batched dot product: no third [tokens, vocab] tensor, float32 under autocast
        return taken, -torch.einsum("...v,...v->...", p, logp)


def _has_logit_postprocessing(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    return any(getattr(config, name, None) for name in ("final_logit_softcapping", "logit_scale", "logits_scaling"))


#: Keys of a collated batch that are forward inputs: the token layout, and a vision-language batch's images
#: (:class:`rlflow.models.vision.VisionBatches`).
INPUT_KEYS = ("input_ids", "attention_mask", "position_ids", "pixel_values", "image_grid_thw", "mm_token_type_ids")


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The forward's keyword arguments from a collated batch (a batch with images has no ``position_ids``: the
    model computes its multimodal positions itself)."""
    return {key: batch[key] for key in INPUT_KEYS if key in batch}


def completion_logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float = 1.0, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies ``[batch, completion_width]`` of a collated batch's completion tokens.

    ``batch`` comes from :func:`rlflow.data.experience.collate`: prompts left-padded then completions, so the
    hidden states just before each completion token are the last ``width`` positions shifted by one.
    """
    targets = batch["completion_ids"]
    width = targets.shape[1]
    inputs = model_inputs(batch)
    lm_head = model.get_output_embeddings()
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if lm_head is None or base is None or _has_logit_postprocessing(model):
        logits = model(**inputs, logits_to_keep=width + 1).logits[:, :-1]
        return naive_token_stats(logits, targets, temperature)
    hidden = base(**inputs, use_cache=False).last_hidden_state[:, -width - 1 : -1]
    return token_stats_from_hidden(hidden, targets, lm_head, temperature, chunk_size)
