"""Per-token log-probs and entropy of completion tokens, without the whole ``[tokens, vocab]`` logits tensor.

The decoder runs once to its last hidden state; the LM head is then applied to ``chunk_size`` positions at a
time, each chunk's float32 logits turned into the log-prob of the taken token and the entropy and dropped.
Under autograd each chunk is recomputed in the backward pass, whose gradient is written out by hand (so the
peak holds about two chunks of logits instead of every position's, and fewer than generic activation
checkpointing would keep). Under autocast (``trainer.precision: bf16-mixed``) the LM head's matmul runs in the
autocast dtype, in forward and in the recomputing backward alike, while the log-softmax, the taken log-prob and
the entropy are float32; an :class:`~rlflow.models.lm_head.FP32Linear` head (``model.policy.cast_lm_head_to_fp32``)
runs its
matmul in float32 instead. Simplification: the LM head is applied as the model's output
embedding layer alone, so models with a final logit soft-cap or scale fall back to the model's own logits.
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


def _entropy(p: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """``-sum(p * logp)`` as a batched dot product (no third ``[rows, vocab]`` temporary), in float32 even
    under autocast (which would run einsum in bf16)."""
    with no_autocast(p.device.type):
        return -torch.einsum("...v,...v->...", p, logp)


def _stats_from_logp(logp: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Taken-token log-prob and entropy from log-softmax output, with one more ``[rows, vocab]`` tensor at most."""
    taken = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return taken, _entropy(logp.exp(), logp)


def _chunk_stats(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias, temperature: float):
    """One chunk's statistics, never under autograd (the autograd path is :class:`_ChunkedTokenStats`)."""
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if temperature != 1.0:
        logits.div_(temperature)
    logp = torch.log_softmax(logits, dim=-1)
    del logits  # the chunk's logits go before its probabilities come
    return _stats_from_logp(logp, targets)


class _ChunkedTokenStats(torch.autograd.Function):
    """LM head + log-softmax + taken log-prob + entropy, chunk by chunk, with a hand-written backward.

    Forward keeps only the inputs; backward recomputes each chunk's log-probs and forms the gradient of the
    logits in place from the closed forms ``d logp_t / dz = onehot(t) - p`` and ``d H / dz = -p * (logp + H)``,
    so at most about two ``[chunk, vocab]`` float32 tensors exist at any time (generic activation
    checkpointing holds four to six there).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size):
        outs = [
            _chunk_stats(hidden[s : s + chunk_size], targets[s : s + chunk_size], weight, bias, temperature)
            for s in range(0, targets.numel(), chunk_size)
        ]
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.autocast = _autocast_state(hidden.device.type)  # backward recomputes the logits under the same state
        return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        with _autocast(ctx.saved_tensors[0].device.type, ctx.autocast):
            return _ChunkedTokenStats._backward(ctx, grad_logp, grad_entropy)

    @staticmethod
    def _backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        temperature, chunk = ctx.temperature, ctx.chunk_size
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for s in range(0, targets.numel(), chunk):
            h, t = hidden[s : s + chunk], targets[s : s + chunk]
            rows = t.numel()
            g_lp = grad_logp[s : s + chunk].float() if grad_logp is not None else h.new_zeros(rows, dtype=torch.float32)
            g_ent = grad_entropy[s : s + chunk].float() if grad_entropy is not None else torch.zeros_like(g_lp)
            z = torch.nn.functional.linear(h, weight, bias).float()
            if temperature != 1.0:
                z.div_(temperature)  # z is a fresh tensor: scale it in place
            logp = torch.log_softmax(z, dim=-1)
            del z
            p = logp.exp()
            entropy = _entropy(p, logp)
            # grad_z = g_lp * (onehot - p) - g_ent * p * (logp + H), built in place in p's storage
            logp.add_(entropy.unsqueeze(-1)).mul_(g_ent.unsqueeze(-1)).add_(g_lp.unsqueeze(-1))
            grad_z = p.mul_(logp).neg_()
            del logp
            grad_z.scatter_add_(-1, t.unsqueeze(-1), g_lp.unsqueeze(-1))
            if temperature != 1.0:
                grad_z.div_(temperature)
            gz = grad_z.to(weight.dtype)
            if need_h:
                grad_h[s : s + chunk] = gz @ weight
            if need_w:
                grad_w += (gz.t() @ h.to(weight.dtype)).float()
            if need_b:
                grad_b += grad_z.sum(0)
            del grad_z, gz
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
            outs = [
                _chunk_stats(flat_h[s : s + chunk_size], flat_t[s : s + chunk_size], weight, bias, temperature)
                for s in range(0, flat_t.numel(), chunk_size)
            ]
            lp, ent = torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])
    return lp.view(shape), ent.view(shape)


def naive_token_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same statistics from full logits (the fallback path, and the reference the chunked path is checked
    against)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return _stats_from_logp(torch.log_softmax(logits, dim=-1), targets)


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
