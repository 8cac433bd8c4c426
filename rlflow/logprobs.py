"""Per-token log-probs and entropy of completion tokens, without the whole ``[tokens, vocab]`` logits tensor.

The decoder runs once to its last hidden state; the LM head is then applied to ``chunk_size`` positions at a
time, each chunk's float32 logits turned into the log-prob of the taken token and the entropy and dropped.
Under autograd each chunk is recomputed in the backward pass (activation checkpointing), so the peak holds one
chunk of logits instead of all of them. Simplification: the LM head is applied as the model's output
embedding layer alone, so models with a final logit soft-cap or scale fall back to the model's own logits.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk_stats(hidden: torch.Tensor, targets: torch.Tensor, weight: torch.Tensor, bias, temperature: float):
    logits = torch.nn.functional.linear(hidden, weight, bias).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    taken = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return taken, entropy


def token_stats_from_hidden(
    hidden: torch.Tensor, targets: torch.Tensor, lm_head: torch.nn.Module, temperature: float = 1.0, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``targets`` and entropies from ``hidden`` (``[..., H]``) through ``lm_head``, chunk by chunk."""
    shape = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    outs_lp, outs_ent = [], []
    for start in range(0, flat_t.numel(), chunk_size):
        h, t = flat_h[start: start + chunk_size], flat_t[start: start + chunk_size]
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            lp, ent = checkpoint(_chunk_stats, h, t, weight, bias, temperature, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(h, t, weight, bias, temperature)
        outs_lp.append(lp)
        outs_ent.append(ent)
    cat = lambda xs: torch.cat(xs) if xs else flat_h.new_zeros(0, dtype=torch.float32)  # noqa: E731
    return cat(outs_lp).view(shape), cat(outs_ent).view(shape)


def naive_token_stats(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The same statistics from full logits (the reference the chunked path is checked against)."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _has_logit_postprocessing(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    return bool(getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None))


def completion_logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float = 1.0, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies ``[batch, completion_width]`` of a collated batch's completion tokens.

    ``batch`` comes from :func:`rlflow.data.experience.collate`: prompts left-padded then completions, so the
    hidden states just before each completion token are the last ``width`` positions shifted by one.
    """
    targets = batch["completion_ids"]
    width = targets.shape[1]
    inputs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    lm_head = model.get_output_embeddings()
    if lm_head is None or _has_logit_postprocessing(model):
        logits = model(**inputs, logits_to_keep=width + 1).logits[:, :-1]
        return naive_token_stats(logits, targets, temperature)
    base = getattr(model, model.base_model_prefix)
    hidden = base(**inputs, use_cache=False).last_hidden_state[:, -width - 1: -1]
    return token_stats_from_hidden(hidden, targets, lm_head, temperature, chunk_size)
