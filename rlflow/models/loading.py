"""Building the models of a GRPO run from its settings: the policy, the KL reference, LoRA's PEFT wrapper and a
vision-language policy's image inputs.

:func:`build_models` is what :meth:`GRPOModule.configure_model <rlflow.training.module.GRPOModule.configure_model>`
calls; :func:`build_policy` with ``training=False`` is what the HF export (:mod:`rlflow.training.export`) loads a
checkpoint's weights into. The policy is set up in a fixed order: loaded (:func:`load_causal_lm`), dropout off
(``model.policy.disable_dropout``), a VLM's processor and frozen vision tower, the fast RMSNorm backward,
activation checkpointing, LoRA adapters (``model.lora``), the float32 LM head; then the reference is loaded when
the loss has a KL term: a separate model (``model.reference.path``, or ``model.model_path`` again), or, under
``model.lora`` without a reference path, none at all (the reference is the policy with its adapters disabled,
:func:`rlflow.models.lora.adapters_disabled`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlflow.config_error import ConfigError
from rlflow.log import info
from rlflow.models.model_path import check_model_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_causal_lm(
    path: str, dtype: str = "float32", attn_implementation: str | None = None, key: str = "model.model_path"
) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` (``AutoModelForImageTextToText`` for a vision-language model, see
    :mod:`rlflow.models.vision`) with a fast, clear error (naming ``key``) for a path that is neither on disk nor
    loadable from the hub (see :mod:`rlflow.models.model_path`)."""
    from rlflow.models.vision import model_auto_class

    if dtype not in DTYPES:
        raise ConfigError(f"model.policy.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_model_path(path, key)
    local = Path(path).expanduser()
    kwargs: dict[str, Any] = {"dtype": DTYPES[dtype]}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    path = str(local) if local.exists() else path
    return model_auto_class(path).from_pretrained(path, **kwargs)


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass (``model.policy.gradient_checkpointing``):
    transformers' ``activation_checkpointing_enable``, or ``gradient_checkpointing_enable`` (its deprecated name,
    the only one before transformers 5.x), and no KV cache, which checkpointed layers cannot fill."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.config.use_cache = False


@dataclass
class Models:
    """What :func:`build_models` returns."""

    policy: torch.nn.Module
    """The transformers model that trains and runs (under LoRA: with the adapters injected in place)."""
    peft: Any = None
    """PEFT's ``PeftModel`` wrapper of the policy under ``model.lora`` (``peft.get_base_model() is policy``)."""
    vision: Any = None
    """:class:`rlflow.models.vision.VisionBatches` of a vision-language policy."""
    reference: torch.nn.Module | None = None
    """The separate KL reference, frozen (None: no KL term, or LoRA's adapters-disabled policy is the
    reference)."""
    router_aux: float = 0.0
    """The weight of a mixture-of-experts policy's load-balancing loss (0: none)."""


def build_policy(model_path: str, policy: Any, lora: Any = None, training: bool = True) -> Models:
    """The policy of ``model.model_path`` set up by the ``model.policy`` settings (see the module docstring), with
    ``model.lora``'s adapters. ``training=False`` (an export) leaves out what only changes how it trains (dropout,
    the vision inputs and frozen tower, the RMSNorm backward, activation checkpointing, the MoE loss weight)."""
    from rlflow.models.lm_head import cast_lm_head_to_fp32

    model = load_causal_lm(model_path, policy.dtype, policy.attn_implementation)
    models = Models(policy=model)
    if training:
        model.train()
        prepare_for_training(models, model_path, policy)
    if lora is not None:  # adapters injected in place: the policy stays the model that runs
        from rlflow.models.lora import apply_lora

        models.peft = apply_lora(model, lora)
    if policy.cast_lm_head_to_fp32:
        cast_lm_head_to_fp32(model)
    if training:
        from rlflow.models.moe import router_aux_coef

        models.router_aux = router_aux_coef(model, policy.router_aux_loss_coef)
    return models


def prepare_for_training(models: Models, model_path: str, policy: Any) -> None:
    """Dropout off, a VLM's image inputs (and frozen vision tower), the fast RMSNorm backward and activation
    checkpointing, as ``model.policy`` says."""
    from rlflow.models.dropout import disable_dropout
    from rlflow.models.rms_norm import use_fast_rms_norm

    model = models.policy
    if policy.disable_dropout:
        switched = disable_dropout(model)
        if switched:
            info(f"model.policy.disable_dropout: set {len(switched)} dropout probabilities of the policy to 0 "
                 f"({', '.join(switched[:3])}{', ...' if len(switched) > 3 else ''})")
    models.vision = vision_batches(model, model_path, policy.freeze_vision_tower)
    if policy.fast_rms_norm:
        use_fast_rms_norm(model)
    if policy.gradient_checkpointing:
        enable_activation_checkpointing(model)


def vision_batches(model: torch.nn.Module, model_path: str, freeze: bool) -> Any:
    """A vision-language policy's :class:`~rlflow.models.vision.VisionBatches` (its processor for the training
    forwards), with its vision tower frozen unless ``freeze`` is false; None for a text-only policy."""
    from rlflow.models.vision import VisionBatches, freeze_vision_tower, is_vision_model, load_processor

    if not is_vision_model(model):
        return None
    batches = VisionBatches(model, load_processor(model_path))
    if freeze:
        frozen = freeze_vision_tower(model)
        info(f"model.policy.freeze_vision_tower: {frozen:,} vision-tower parameters frozen")
    return batches


def build_reference(model_path: str, policy: Any, reference: Any) -> torch.nn.Module:
    """The frozen KL reference: ``model.reference.path`` (or ``model.model_path``), loaded like the policy, with
    the float32 LM head where the policy has it. In eval mode; no parameter requires a gradient."""
    from rlflow.models.lm_head import cast_lm_head_to_fp32

    key = "model.reference.path" if reference.path else "model.model_path"
    ref = load_causal_lm(reference.path or model_path, policy.dtype, policy.attn_implementation, key)
    ref.requires_grad_(False)
    if policy.cast_lm_head_to_fp32:
        cast_lm_head_to_fp32(ref)
    return ref.eval()


def build_models(model_path: str, policy: Any, reference: Any, lora: Any, uses_reference: bool) -> Models:
    """The policy (:func:`build_policy`) and, where the loss has a KL term and LoRA's adapters-disabled policy
    is not the reference, the separate reference (:func:`build_reference`); a reference that
    ``model.reference.sync_steps`` will move must have the policy's parameters."""
    models = build_policy(model_path, policy, lora)
    if uses_reference and (lora is None or reference.path):
        models.reference = build_reference(model_path, policy, reference)
        if reference.sync_steps:
            from rlflow.training.reference import check_same_layout

            check_same_layout(models.policy, models.reference)
    return models
