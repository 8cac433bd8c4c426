"""RMSNorm for training with a hand-written backward pass: the same forward, fewer passes over memory backward.

Why: transformers' ``LlamaRMSNorm``/``Qwen3RMSNorm`` is ``weight * (x * rsqrt(mean(x^2) + eps))``, six operators
whose backward autograd runs operator by operator: about eleven passes over ``[tokens, hidden]`` tensors (the
``pow``, ``mean`` and the two products each differentiated apart, their gradients summed). A decoder has two per
layer, plus Qwen3's q/k norms and the final one, and at small model sizes those passes are a visible share of a
training step on a CPU. With ``n = x * r``,
``r = rsqrt(mean(x^2) + eps)`` and ``gn = grad * weight``, the gradient is

    dL/dx = r * (gn - n * mean(gn * n))        dL/dweight = sum over tokens of grad * n

which :class:`RMSNormFunction` computes in seven passes, saving ``n`` and ``r`` from the forward. The forward is
the model's own operators in the model's order, so outputs are bit-identical; gradients agree with autograd's to
float32 rounding (the tests check both, and the gradient against a float64 recomputation).

:func:`use_fast_rms_norm` puts it on a model's RMSNorm modules (``model.policy.fast_rms_norm``, on by default), as
an instance ``forward``: no transformers class or function is patched, so other models in the process keep theirs.

Simplifications: float32 inputs and weights with gradients enabled only (the forward of any other call, bf16
under FSDP's mixed precision or a no-grad pass, is the module's own); RMSNorm modules are recognised by a class
name ending in ``RMSNorm`` with ``weight`` and ``variance_epsilon`` attributes whose forward gives the same bits on
a random input (:func:`is_rms_norm`: Llama, Qwen2, Qwen3, Mistral and their relatives; not a ``(1 + weight) *
normed`` variant).
"""

from __future__ import annotations

import types

import torch


class RMSNormFunction(torch.autograd.Function):
    """``weight * (x * rsqrt(mean(x^2, -1) + eps))`` in float32, with the backward of the module docstring."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)  # the model's operators, in its order
        n = x * r
        ctx.save_for_backward(weight, n, r)
        return weight * n

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        weight, n, r = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gn = grad * weight
            grad_x = torch.addcmul(gn, n, (gn * n).mean(-1, keepdim=True), value=-1.0).mul_(r)
        if ctx.needs_input_grad[1]:
            grad_w = (grad * n).reshape(-1, n.shape[-1]).sum(0)
        return grad_x, grad_w, None


def fast_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """An RMSNorm module's ``forward``: :class:`RMSNormFunction` where it applies, the module's own elsewhere."""
    if (hidden_states.dtype == torch.float32 and self.weight.dtype == torch.float32 and torch.is_grad_enabled()
            and (hidden_states.requires_grad or self.weight.requires_grad)):
        return RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)
    return type(self).forward(self, hidden_states)


def is_rms_norm(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an RMSNorm whose forward is ``weight * x * rsqrt(mean(x^2) + eps)``: a class name
    ending in ``RMSNorm`` with ``weight`` and ``variance_epsilon``, whose own forward gives, on a random float32
    input, exactly what :class:`RMSNormFunction` gives (a variant such as ``(1 + weight) * normed`` fails it; checked
    once per class)."""
    name = type(module).__name__
    if not (name.endswith("RMSNorm") and isinstance(getattr(module, "weight", None), torch.Tensor)
            and isinstance(getattr(module, "variance_epsilon", None), float)):
        return False
    if type(module) not in _CHECKED:
        _CHECKED[type(module)] = _same_forward(module)
    return _CHECKED[type(module)]


_CHECKED: dict[type, bool] = {}


@torch.no_grad()
def _same_forward(module: torch.nn.Module) -> bool:
    weight = module.weight
    if weight.device.type == "meta" or weight.dtype != torch.float32:
        return not type(module).__name__.startswith("Gemma")  # nothing to run: the name rule alone
    x = torch.randn(3, weight.shape[-1], generator=torch.Generator().manual_seed(0), device="cpu").to(weight.device)
    mine = RMSNormFunction.apply(x, weight, module.variance_epsilon)
    return torch.equal(type(module).forward(module, x), mine)


def use_fast_rms_norm(model: torch.nn.Module) -> int:
    """Give every RMSNorm module of ``model`` :func:`fast_forward`; returns how many."""
    count = 0
    for module in model.modules():
        if "forward" not in module.__dict__ and is_rms_norm(module):
            module.forward = types.MethodType(fast_forward, module)
            count += 1
    return count
