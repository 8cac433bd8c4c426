"""Per-token KL estimators between the policy and the reference (Schulman's k1, k2, k3 and |k1|).

With ``log_ratio = logprobs - ref_logprobs`` on tokens sampled from the policy: k1 = log_ratio, k2 =
log_ratio**2 / 2, k3 (``low_var_kl``) = exp(-log_ratio) + log_ratio - 1, abs = |log_ratio|. k3 clamps
``-log_ratio`` to [-20, 20] before the exponential and the result to [-10, 10], as verl's ``low_var_kl`` does,
so that one wild token cannot blow up the loss (inside those bounds it equals TRL's k3 exactly).
"""

from __future__ import annotations

import torch

from rlflow.config_error import ConfigError

KL_TYPES = ("k1", "k2", "k3", "low_var_kl", "abs")


def check_kl_type(kl_type: str) -> str:
    if kl_type not in KL_TYPES:
        raise ConfigError(f"unknown kl_type {kl_type!r}; choose one of {', '.join(KL_TYPES)}")
    return kl_type


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kl_type: str = "k3") -> torch.Tensor:
    """Per-token KL estimate of ``kl_type``; see the module docstring for the formulas."""
    log_ratio = logprobs - ref_logprobs
    if kl_type == "k1":
        return log_ratio
    if kl_type == "k2":
        return 0.5 * log_ratio.square()
    if kl_type in ("k3", "low_var_kl"):
        neg = (-log_ratio).clamp(min=-20.0, max=20.0)
        return (torch.exp(neg) - neg - 1.0).clamp(min=-10.0, max=10.0)
    if kl_type == "abs":
        return log_ratio.abs()
    check_kl_type(kl_type)
    raise AssertionError("unreachable")
