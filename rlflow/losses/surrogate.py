"""The shared body of the importance-ratio policy losses (grpo, bnpo, dr_grpo, dapo, gspo, luspo, cispo, sapo,
vespo).

Per micro-batch, in TRL's order: the loss mask (optionally without truncated completions); the importance
ratio ``exp(logprobs - old_logprobs)`` per token, or per sequence from the mean log-ratio over its tokens
(``importance_sampling_level: sequence``, GSPO); the subclass's per-token objective; the off-policy sequence
mask (``off_policy_mask_threshold``); the high-entropy token mask (``top_entropy_quantile``); the
rollout/training mismatch weights (TIS/MIS; a loss with ``own_importance_weights``, VESPO, folds them into its
objective instead); ``+ kl_coef * KL`` to the reference (times the ratio with ``use_bias_correction_kl``,
DeepSeek-V3.2's unbiased KL gradient, as TRL); ``- entropy_coef * entropy`` (the coefficient adaptive with
``use_adaptive_entropy``, :mod:`rlflow.losses.entropy_control`); then the aggregation
(:mod:`rlflow.losses.aggregation`). The log-ratio is clamped to [-20, 20] before the exponential, as verl does
(never reached by sane ratios).
"""

from __future__ import annotations

import torch

from rlflow.config_error import ConfigError
from rlflow.losses.aggregation import UNITS, aggregate, check_aggregation
from rlflow.losses.base import LossContext, PolicyLoss, masked_mean
from rlflow.losses.entropy_control import AdaptiveEntropy
from rlflow.losses.kl import check_kl_type, kl_penalty
from rlflow.losses.masks import high_entropy_mask, off_policy_sequence_mask, truncated_mask

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


def check_options(epsilon_low: float, epsilon_high: float | None, kl_coef: float, kl_type: str,
                  importance_sampling_level: str, top_entropy_quantile: float, entropy_coef: float,
                  off_policy_mask_threshold: float | None) -> None:
    """Refuse a :class:`RatioPolicyLoss` option out of its range (a :class:`~rlflow.config_error.ConfigError`)."""
    check_kl_type(kl_type)
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ConfigError(
            f"importance_sampling_level must be 'token' or 'sequence', got {importance_sampling_level!r}"
        )
    if not 0.0 <= epsilon_low < 1.0:
        raise ConfigError(f"epsilon_low must be in [0, 1), got {epsilon_low}")
    if epsilon_high is not None and epsilon_high < 0.0:
        raise ConfigError(f"epsilon_high must be >= 0, got {epsilon_high}")
    if not 0.0 < top_entropy_quantile <= 1.0:
        raise ConfigError(f"top_entropy_quantile must be in (0, 1], got {top_entropy_quantile}")
    if kl_coef < 0.0 or entropy_coef < 0.0:
        raise ConfigError(f"kl_coef and entropy_coef must be >= 0, got {kl_coef} and {entropy_coef}")
    if off_policy_mask_threshold is not None and not off_policy_mask_threshold >= 0.0:
        raise ConfigError(f"off_policy_mask_threshold must be >= 0 (or null), got {off_policy_mask_threshold}")


class RatioPolicyLoss(PolicyLoss):
    """Shared options and pipeline; a subclass supplies :meth:`objective` and its default aggregation."""

    #: Default normaliser of the subclass (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo`` or ``luspo``).
    default_aggregation: str = "grpo"
    #: Whether :meth:`objective` takes the per-token log-ratio and the rollout IS weights itself (VESPO), rather
    #: than the pipeline multiplying the per-token loss by those weights.
    own_importance_weights: bool = False
    #: Whether :meth:`objective` is the advantage times terms with finite values (its gradient 0 where the
    #: advantage is 0): true of every built-in objective; a subclass with another term leaves it False.
    objective_scales_with_advantage: bool = False

    def __init__(
        self,
        epsilon_low: float = 0.2,
        epsilon_high: float | None = None,
        kl_coef: float = 0.0,
        kl_type: str = "k3",
        use_bias_correction_kl: bool = False,
        importance_sampling_level: str = "token",
        mask_truncated_completions: bool = False,
        top_entropy_quantile: float = 1.0,
        entropy_coef: float = 0.0,
        use_adaptive_entropy: bool = False,
        entropy_target: float = 0.2,
        entropy_coef_min: float = 0.0,
        entropy_coef_max: float = 1.0,
        entropy_coef_delta: float = 0.005,
        off_policy_mask_threshold: float | None = None,
        max_tokens: int | None = None,
        aggregation: str | None = None,
    ) -> None:
        """
        Args:
            epsilon_low: Lower clip range of the importance ratio (``1 - epsilon_low``).
            epsilon_high: Upper clip range (``1 + epsilon_high``); None means ``epsilon_low``. DAPO's clip-higher uses
                0.28.
            kl_coef: Weight of the KL penalty to the reference model (needs ``ref_logprobs``); 0 disables it.
            kl_type: KL estimator: ``k1``, ``k2``, ``k3`` (= ``low_var_kl``) or ``abs``.
            use_bias_correction_kl: Multiply the per-token KL by the importance ratio ``exp(logprobs -
                old_logprobs)`` (differentiable, so the gradient changes even where it is 1), which makes the KL
                gradient the unbiased reverse-KL gradient for tokens sampled by the old policy (DeepSeek-V3.2;
                TRL's ``use_bias_correction_kl``, true by default there). The logged ``kl`` is the corrected one, as
                in TRL. With ``importance_sampling_level: sequence`` the sequence ratio is broadcast.
            importance_sampling_level: ``token`` (PPO/GRPO) or ``sequence`` (GSPO: one ratio per completion, from the
                mean token log-ratio).
            mask_truncated_completions: Leave completions cut at ``max_tokens`` out of the loss (DAPO's overlong
                filtering).
            top_entropy_quantile: Train only on this fraction of tokens with the highest entropy; 1.0 trains on all.
            entropy_coef: Weight of an entropy bonus (subtracted from the loss); 0 disables it. With
                ``use_adaptive_entropy``, its starting value.
            use_adaptive_entropy: Adaptive entropy control (Skywork-OR1; TRL's option): after every optimizer step
                the coefficient moves by ``entropy_coef_delta`` up when the step's entropy (the loss's tokens, all
                micro-batches and ranks) was at or below ``entropy_target``, down otherwise, within
                ``[entropy_coef_min, entropy_coef_max]``; the bonus applies only while that entropy is at or below
                the target. Logged as ``entropy_coef``; checkpointed (:mod:`rlflow.losses.entropy_control`).
            entropy_target: Target mean per-token entropy in nats (TRL's default 0.2 engages only near collapse:
                set it near the ``entropy`` logged early in training).
            entropy_coef_min: Lower bound of the adaptive coefficient.
            entropy_coef_max: Upper bound of the adaptive coefficient.
            entropy_coef_delta: The adaptive coefficient's step per optimizer step.
            off_policy_mask_threshold: Off-policy sequence masking (DeepSeek-V3.2; TRL's option of the same name):
                leave out of the loss a completion with a negative advantage whose mean per-token ``sampler log-prob
                - current log-prob`` exceeds this (e.g. 0.5). The sampler's log-probs are the rollout engine's
                when given, else ``old_logprobs``. Logged as ``off_policy_mask/dropped_ratio``. None disables it.
            max_tokens: Completion budget, the ``dr_grpo`` normaliser when no ``LossContext`` is given.
            aggregation: Override the normaliser: ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo`` or ``luspo``; None keeps
                the loss's own.
        """
        check_options(epsilon_low, epsilon_high, kl_coef, kl_type, importance_sampling_level,
                      top_entropy_quantile, entropy_coef, off_policy_mask_threshold)
        self.epsilon_low = epsilon_low
        self.epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
        self.kl_coef = kl_coef
        self.kl_type = kl_type
        self.use_bias_correction_kl = use_bias_correction_kl
        self.importance_sampling_level = importance_sampling_level
        self.mask_truncated_completions = mask_truncated_completions
        self.top_entropy_quantile = top_entropy_quantile
        self.entropy_coef = entropy_coef
        self.adaptive_entropy = AdaptiveEntropy(entropy_coef, entropy_target, entropy_coef_min, entropy_coef_max,
                                                entropy_coef_delta) if use_adaptive_entropy else None
        self.off_policy_mask_threshold = off_policy_mask_threshold
        self.max_tokens = max_tokens
        self.aggregation = check_aggregation(aggregation or self.default_aggregation)

    @property
    def unit(self) -> str:  # type: ignore[override]
        return UNITS[self.aggregation]

    def zero_advantage_gradient(self) -> str | None:
        if not self.objective_scales_with_advantage:
            return super().zero_advantage_gradient()
        if self.kl_coef > 0.0:
            return f"kl_coef={self.kl_coef} (the KL term has a gradient at any advantage)"
        if self.entropy_coef > 0.0 or self.adaptive_entropy is not None:
            return "an entropy bonus (entropy_coef > 0 or use_adaptive_entropy) has a gradient at any advantage"
        if self.top_entropy_quantile < 1.0:
            return (f"top_entropy_quantile={self.top_entropy_quantile} picks its tokens over each micro-batch, "
                    "so leaving sequences out would change which tokens train")
        return None

    def objective(
        self, coef: torch.Tensor, logprobs: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Per-token loss (``[batch, tokens]`` or ``[batch, 1]``) from the ratio ``coef`` and ``adv`` (``[batch, 1]``),
        and boolean ``[batch, tokens|1]`` indicator tensors whose masked means become metrics."""
        raise NotImplementedError

    def log_importance_weights(
        self, logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        log_ratio = logprobs - old_logprobs
        if self.importance_sampling_level == "sequence":
            m = mask.to(log_ratio.dtype)
            log_ratio = ((log_ratio * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0))
        return log_ratio.clamp(min=-20.0, max=20.0)

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        ref_logprobs: torch.Tensor | None = None,
        rollout_logprobs: torch.Tensor | None = None,
        *,
        entropy: torch.Tensor | None = None,
        truncated: torch.Tensor | None = None,
        rollout_is_weights: torch.Tensor | None = None,
        ctx: LossContext | None = None,
        **extra,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mask.bool()
        if self.mask_truncated_completions:
            mask = truncated_mask(mask, truncated)
        adv = advantages.to(logprobs.dtype)
        adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
        log_ratio = self.log_importance_weights(logprobs, old_logprobs.to(logprobs.dtype), mask)
        coef = torch.exp(log_ratio)
        if self.own_importance_weights:
            per_token, indicators = self.objective(coef, logprobs, adv, mask, log_ratio=log_ratio,
                                                   rollout_is_weights=rollout_is_weights)
        else:
            per_token, indicators = self.objective(coef, logprobs, adv, mask)
        per_token = per_token.expand(mask.shape)
        if self.off_policy_mask_threshold is not None:
            sampling = rollout_logprobs if rollout_logprobs is not None else old_logprobs
            keep = off_policy_sequence_mask(adv, logprobs, sampling, mask, self.off_policy_mask_threshold)
            per_token = per_token * keep
            indicators = {**indicators, "off_policy_mask/dropped_ratio": keep == 0}
        trained = mask  # the tokens the policy term trains on (adaptive entropy control measures them)
        if self.top_entropy_quantile < 1.0:
            trained = high_entropy_mask(entropy, mask, self.top_entropy_quantile)
            per_token = per_token * trained
        if rollout_is_weights is not None and not self.own_importance_weights:
            per_token = per_token * rollout_is_weights.to(per_token.dtype)
        metrics: dict[str, float] = {}
        if self.kl_coef > 0.0:
            if ref_logprobs is None:
                raise ValueError("kl_coef > 0 needs ref_logprobs from a reference model")
            kl = kl_penalty(logprobs, ref_logprobs.to(logprobs.dtype), self.kl_type)
            if self.use_bias_correction_kl:
                kl = kl * coef
            per_token = per_token + self.kl_coef * kl
            metrics["kl"] = masked_mean(kl.detach(), mask).item()
        entropy_coef = self.entropy_coef
        if self.adaptive_entropy is not None:
            if entropy is None:
                raise ValueError("use_adaptive_entropy needs the per-token 'entropy' of the policy")
            entropy_coef = self.adaptive_entropy.applied()
            self.adaptive_entropy.observe(entropy, trained)
        if entropy_coef > 0.0:
            if entropy is None:
                raise ValueError("entropy_coef > 0 needs the per-token 'entropy' of the policy")
            per_token = per_token - entropy_coef * entropy
        loss = aggregate(per_token, mask, self.aggregation, ctx, self.max_tokens)
        for name, flags in indicators.items():
            metrics[name] = self._indicator_mean(flags, mask)
        return loss, metrics

    def on_optimizer_step(self, reduce_sum=None) -> dict[str, float]:
        if self.adaptive_entropy is None:
            return {}
        return {"entropy_coef": self.adaptive_entropy.step(reduce_sum)}

    def on_skipped_step(self) -> None:
        if self.adaptive_entropy is not None:
            self.adaptive_entropy.discard()

    def state_dict(self) -> dict:
        return {} if self.adaptive_entropy is None else {"adaptive_entropy": self.adaptive_entropy.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.adaptive_entropy is not None and "adaptive_entropy" in state:
            self.adaptive_entropy.load_state_dict(state["adaptive_entropy"])

    @staticmethod
    def _indicator_mean(flags: torch.Tensor, mask: torch.Tensor) -> float:
        """TRL's ``masked_batch_mean``: a sequence-level flag (or value) is averaged over sequences, a token flag
        over tokens."""
        flags = flags.detach().float()
        if flags.shape[-1] == 1 and mask.shape[-1] != 1:
            return flags.mean().item()
        return masked_mean(flags, mask).item()
