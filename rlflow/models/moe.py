"""The mixture-of-experts load-balancing loss in GRPO training (``model.policy.router_aux_loss_coef``, TRL's option).

Why: an MoE policy's router is trained by the policy gradient alone once its pre-training's auxiliary loss is gone,
and RL updates that favour a few experts unbalance it (some experts overloaded, others never trained). transformers'
MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, ...) add ``router_aux_loss_coef * load_balancing_loss`` to their
language-modelling loss; rlflow computes log-probs from the decoder's hidden states instead, so it collects the
router logits of each training forward itself (a hook on the base model while ``output_router_logits`` is on) and
adds the same term, with the architecture's own ``load_balancing_loss_func`` over the forward's attention mask
(all tokens of a packed micro-batch). ``None`` uses the coefficient in the model's config (TRL's default); 0 turns
it off; a value for a model without a router is a config error.

Simplification: the term is a micro-batch's mean, weighted like the micro-batch's policy loss; the old-policy and
reference passes do not compute it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from rlflow.config_error import ConfigError
from rlflow.models.lora import unwrap_peft


def router_settings(model: Any) -> tuple[int, int, Any] | None:
    """``(num_experts, experts per token, load_balancing_loss_func)`` of an MoE causal LM whose forward adds the
    load-balancing loss; None for other models."""
    model = unwrap_peft(model)
    config = getattr(model, "config", None)
    # the architecture's module (FSDP2's fully_shard makes a subclass defined in torch: look through the MRO)
    fn = next((f for cls in type(model).__mro__
               if (f := getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)) is not None), None)
    experts, top_k = getattr(model, "num_experts", None), getattr(model, "num_experts_per_tok", None)
    if config is None or not hasattr(config, "output_router_logits") or fn is None or not experts or not top_k:
        return None
    return int(experts), int(top_k), fn


def router_aux_coef(model: Any, coef: float | None) -> float:
    """The coefficient to use: ``coef``, or the config's for None (0 for a model without a router)."""
    settings = router_settings(model)
    if settings is None:
        if coef:
            raise ConfigError(
                f"model.policy.router_aux_loss_coef={coef}, but {type(unwrap_peft(model)).__name__} is not a "
                "mixture-of-experts model with router logits: leave it unset (null) or 0"
            )
        return 0.0
    return float(unwrap_peft(model).config.router_aux_loss_coef if coef is None else coef)


class RouterLogits:
    """What :func:`collect_router_logits` caught: the router logits and attention mask of the last base forward,
    with the model's :func:`router_settings`."""

    def __init__(self, settings: tuple[int, int, Any] | None) -> None:
        self.settings = settings
        self.logits: tuple[torch.Tensor, ...] | None = None
        self.attention_mask: torch.Tensor | None = None

    def aux_loss(self) -> torch.Tensor:
        """The architecture's load-balancing loss of the caught forward (0 if nothing was caught)."""
        if self.settings is None or not self.logits:
            return torch.zeros(())
        experts, top_k, fn = self.settings
        mask = self.attention_mask if self.attention_mask is not None and self.attention_mask.dim() == 2 else None
        return fn(self.logits, experts, top_k, mask)


@contextlib.contextmanager
def collect_router_logits(model: Any) -> Iterator[RouterLogits]:
    """While inside, the model's decoder returns its router logits and the last forward's are caught."""
    inner = unwrap_peft(model)
    base = getattr(inner, getattr(inner, "base_model_prefix", ""), None)
    caught = RouterLogits(router_settings(model) if base is not None else None)
    if caught.settings is None:
        yield caught
        return

    def hook(_module, _args, kwargs, out) -> None:
        caught.logits = getattr(out, "router_logits", None)
        caught.attention_mask = kwargs.get("attention_mask")

    config = inner.config
    previous = config.output_router_logits
    config.output_router_logits = True
    handle = base.register_forward_hook(hook, with_kwargs=True)
    try:
        yield caught
    finally:
        handle.remove()
        config.output_router_logits = previous
