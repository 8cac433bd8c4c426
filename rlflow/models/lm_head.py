"""``model.policy.cast_lm_head_to_fp32``: the LM head's weights and matrix product in float32 (TRL's option of that
name).

Why: the log-probs GRPO trains on are a softmax over a vocabulary of 10^4-10^5 logits, each one bf16 product of a
hidden state and a head row. bf16 keeps 8 bits of mantissa, so two computations of "the same" log-prob (the
sampler's and the trainer's, or two kernels') differ by ~1e-2, which the importance ratio and the KL read as a
policy change (ScaleRL recommends an fp32 head). Here the head becomes :class:`FP32Linear`: its parameters are
cast to float32 (a no-op for rlflow's default float32 master weights) and its product runs in float32 whatever
the surrounding autocast or FSDP2 ``param_dtype`` (under FSDP2's bf16 ``param_dtype`` the unsharded head arrives
in bf16 and is widened, so the product and the logits are float32, its weights rounded once). rlflow's chunked
log-prob path (:mod:`rlflow.training.logprobs`) and the engine's fused decoder (:mod:`rlflow.rollout.fused`) see the
class
and compute the head in float32 too, so sampler and trainer agree.

With tied embeddings the embedding matrix is the same parameter and becomes float32 too; a hook casts the
embedding's output back to the model's dtype, as TRL does. A PEFT adapter on the head is refused. Simplification:
models whose logits are post-processed (soft-capping, scaling) compute them through their own forward, which
calls this head's float32 product as well.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from rlflow.config_error import ConfigError


class FP32Linear(torch.nn.Linear):
    """An ``nn.Linear`` whose product runs in float32 with autocast off (its output is float32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with no_autocast(x.device.type):
            bias = None if self.bias is None else self.bias.float()
            return torch.nn.functional.linear(x.float(), self.weight.float(), bias)


def no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast switched off on ``device_type`` (a no-op where autocast does not exist): products in their inputs'
    dtype (also used by :mod:`rlflow.training.logprobs` for its float32 statistics)."""
    if torch.amp.is_autocast_available(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def is_fp32_head(module: Any) -> bool:
    """Whether ``module`` (a model's output embedding) computes in float32 (:func:`cast_lm_head_to_fp32`)."""
    return isinstance(module, FP32Linear)


def cast_lm_head_to_fp32(model: torch.nn.Module) -> None:
    """Make ``model``'s output embedding an :class:`FP32Linear` with float32 parameters, in place."""
    head = model.get_output_embeddings()
    if is_fp32_head(head):  # again (e.g. after a ``.to(bfloat16)`` of the whole model): widen its weights again
        head.float()
        return
    if type(head) is not torch.nn.Linear:
        raise ConfigError(
            f"model.policy.cast_lm_head_to_fp32 needs a plain nn.Linear LM head; this model's is a "
            f"{type(head).__name__} (a PEFT adapter on lm_head, or a quantised head): remove it from "
            "the adapter's target modules or set model.policy.cast_lm_head_to_fp32=false"
        )
    original = head.weight.dtype
    embed = model.get_input_embeddings()
    tied = embed is not None and getattr(embed, "weight", None) is head.weight
    head.float()
    head.__class__ = FP32Linear  # same parameters and state_dict keys; deepcopy and pickling keep the class
    if tied and original != torch.float32:
        embed.register_forward_hook(functools.partial(_cast_output, dtype=original))  # picklable: generator process


def _cast_output(_module: torch.nn.Module, _args: Any, output: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return output.to(dtype)
