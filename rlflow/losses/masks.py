"""Masks the policy losses can apply: truncated completions, the high-entropy "forking" tokens, and sequences
that are too far off-policy.

``truncated_mask`` drops completions cut at ``max_tokens`` (DAPO's overlong filtering, TRL's
``mask_truncated_completions``). ``high_entropy_mask`` keeps the ``quantile`` highest-entropy tokens ("Beyond
the 80/20 Rule", TRL's ``top_entropy_quantile``). ``off_policy_sequence_mask`` drops a negative-advantage
completion whose sampler has drifted from the current policy (DeepSeek-V3.2's off-policy sequence masking, TRL's
``off_policy_mask_threshold``). Simplification: the entropy threshold is the quantile over the
micro-batch on this rank (TRL gathers the micro-batch over ranks first).
"""

from __future__ import annotations

import torch


def truncated_mask(mask: torch.Tensor, truncated: torch.Tensor | None) -> torch.Tensor:
    """``mask`` with every row of a truncated completion switched off."""
    if truncated is None:
        raise ValueError("mask_truncated_completions needs the 'truncated' flags of the completions ([batch] bool)")
    truncated = torch.as_tensor(truncated, device=mask.device).bool().reshape(-1)
    if truncated.shape[0] != mask.shape[0]:
        raise ValueError(f"'truncated' has {truncated.shape[0]} flags for {mask.shape[0]} completions")
    return mask.bool() & ~truncated.unsqueeze(1)


def high_entropy_mask(entropy: torch.Tensor | None, mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """True on tokens whose entropy is at or above the ``1 - quantile`` quantile of the masked-in tokens."""
    if entropy is None:
        raise ValueError("top_entropy_quantile < 1 needs the per-token 'entropy' of the policy")
    mask = mask.bool()
    values = entropy.detach().float()[mask]
    if values.numel() == 0:
        return mask
    threshold = torch.quantile(values, 1.0 - quantile)
    return (entropy.detach().float() >= threshold) & mask


def off_policy_sequence_mask(
    advantages: torch.Tensor, logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """``[batch, 1]``: 1.0 to keep a completion, 0.0 to drop it (DeepSeek-V3.2, eq. 9).

    A completion is dropped when its advantage is negative and the mean over its tokens of ``sampling_logprobs -
    logprobs`` (the forward KL from the sampler to the current policy, estimated on the sampled tokens) exceeds
    ``threshold``: a bad sample the current policy would no longer produce teaches little and destabilises. No
    gradient flows through the mask; tokens without a sampler log-prob (NaN) count as no drift, as in TRL.
    """
    m = mask.to(logprobs.dtype)
    drift = torch.nan_to_num(sampling_logprobs.to(logprobs.dtype) - logprobs.detach(), nan=0.0)
    mean_drift = (drift * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    adv = advantages.reshape(-1, 1) if advantages.dim() == 1 else advantages
    return ((adv >= 0) | (mean_drift <= threshold)).to(logprobs.dtype)
