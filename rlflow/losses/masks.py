"""Token masks the policy losses can apply: truncated completions and the high-entropy "forking" tokens.

``truncated_mask`` drops completions cut at ``max_tokens`` (DAPO's overlong filtering, TRL's
``mask_truncated_completions``). ``high_entropy_mask`` keeps the ``quantile`` highest-entropy tokens ("Beyond
the 80/20 Rule", TRL's ``top_entropy_quantile``). Simplification: the entropy threshold is the quantile over the
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
