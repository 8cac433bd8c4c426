"""Per-token KL estimators between the policy and the reference (Schulman's k1, k2, k3 and |k1|).

With ``log_ratio = logprobs - ref_logprobs`` on tokens sampled from the policy: k1 = log_ratio, k2 =
log_ratio**2 / 2, k3 (``low_var_kl``) = exp(-log_ratio) + log_ratio - 1, abs = |log_ratio|. k3 is clamped
to [-10, 10] as verl and XTuner do so that one wild token cannot blow up the loss.
"""

from __future__ import annotations

import torch

KL_TYPES = ("k1", "k2", "k3", "low_var_kl", "abs")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: str = "k3") -> torch.Tensor:
    """Per-token KL estimate of ``kl_type``; see the module docstring for the formulas."""
    log_ratio = logprobs - ref_logprobs
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return 0.5 * log_ratio.square()
    if kl_type in ("k3", "low_var_kl"):
        return (torch.exp(-log_ratio) + log_ratio - 1.0).clamp(min=-10.0, max=10.0)
    if kl_type == "abs":
        return log_ratio.abs()
    raise ValueError(f"unknown kl_type {kl_type!r}; choose one of {', '.join(KL_TYPES)}")
