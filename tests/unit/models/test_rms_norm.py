"""The RMSNorm with a hand-written backward (:mod:`rlflow.models.rms_norm`).

Its forward is compared bit for bit with transformers' own modules; its gradients with a float64 recomputation of
the formula by autograd (independent of the hand-written derivative) and with autograd through the module's own
float32 forward.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from rlflow.models.rms_norm import RMSNormFunction, is_rms_norm, use_fast_rms_norm


def reference_grads(x: torch.Tensor, weight: torch.Tensor, eps: float, grad: torch.Tensor):
    """Gradients of ``sum(grad * weight * x / sqrt(mean(x^2) + eps))`` by autograd in float64."""
    x64 = x.detach().double().requires_grad_()
    w64 = weight.detach().double().requires_grad_()
    out = w64 * x64 / torch.sqrt((x64 * x64).mean(-1, keepdim=True) + eps)
    (out * grad.double()).sum().backward()
    return x64.grad, w64.grad


@pytest.mark.parametrize("cls, shape", [(Qwen3RMSNorm, (3, 57, 64)), (LlamaRMSNorm, (200, 96)),
                                        (Qwen3RMSNorm, (1, 40, 4, 32))])  # the last: Qwen3's per-head q/k norm
def test_forward_is_the_modules_and_gradients_are_the_formulas(cls, shape):
    torch.manual_seed(0)
    dim = shape[-1]
    module = cls(dim, eps=1e-6)
    with torch.no_grad():
        module.weight.copy_(torch.randn(dim) * 0.5 + 1.0)
    x = (torch.randn(shape) * 3.0).requires_grad_()
    grad = torch.randn(shape)
    want = module(x)
    (want * grad).sum().backward()
    auto_x, auto_w = x.grad.clone(), module.weight.grad.clone()
    x.grad = module.weight.grad = None

    assert use_fast_rms_norm(module) == 1
    got = module(x)
    assert torch.equal(got, want)  # the model's operators in its order: bit for bit
    (got * grad).sum().backward()
    ref_x, ref_w = reference_grads(x, module.weight, 1e-6, grad)
    for mine, auto, ref in ((x.grad, auto_x, ref_x), (module.weight.grad, auto_w, ref_w)):
        scale = ref.abs().max().item()
        assert (mine.double() - ref).abs().max().item() <= 2e-6 * scale  # float32 rounding of the exact gradient
        assert (auto.double() - ref).abs().max().item() <= 2e-6 * scale  # (autograd's own is no closer)
        assert (mine - auto).abs().max().item() <= 4e-6 * scale


def test_only_the_input_or_only_the_weight_needs_a_gradient():
    torch.manual_seed(1)
    module = Qwen3RMSNorm(16)
    use_fast_rms_norm(module)
    x, g = torch.randn(5, 16), torch.randn(5, 16)
    ref_x, ref_w = reference_grads(x, module.weight, module.variance_epsilon, g)
    (module(x) * g).sum().backward()  # the weight only (a frozen input)
    assert torch.allclose(module.weight.grad.double(), ref_w, atol=1e-5)
    module.weight.requires_grad_(False)
    xg = x.clone().requires_grad_()
    (module(xg) * g).sum().backward()  # the input only (a frozen weight, as under LoRA)
    assert torch.allclose(xg.grad.double(), ref_x, atol=1e-5)


def test_other_dtypes_and_no_grad_passes_run_the_modules_own_forward(monkeypatch):
    module = Qwen3RMSNorm(8).to(torch.bfloat16)
    use_fast_rms_norm(module)
    calls = []
    monkeypatch.setattr(RMSNormFunction, "apply", lambda *a: calls.append(a))
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    assert torch.equal(module(x), Qwen3RMSNorm.forward(module, x))  # bf16: the module's own, two roundings
    fp32 = Qwen3RMSNorm(8)
    use_fast_rms_norm(fp32)
    with torch.no_grad():
        assert torch.equal(fp32(x.float()), Qwen3RMSNorm.forward(fp32, x.float()))
    assert calls == []


def test_a_model_gets_it_on_every_rms_norm_and_trains_the_same(tiny_model):
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_model)
    fast = AutoModelForCausalLM.from_pretrained(tiny_model)
    layers = plain.config.num_hidden_layers
    assert use_fast_rms_norm(fast) == 4 * layers + 1  # input, post-attention, q and k norms, and the final norm
    assert use_fast_rms_norm(fast) == 0  # once
    assert not is_rms_norm(torch.nn.LayerNorm(4))
    ids = torch.randint(3, 90, (2, 30))
    grads = []
    for model in (plain, fast):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads.append((out.logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert torch.equal(grads[0][0], grads[1][0])  # the forward, bit for bit
    for name, g in grads[0][1].items():
        assert torch.allclose(grads[1][1][name], g, rtol=1e-5, atol=1e-7), name


def test_a_variant_with_another_formula_keeps_its_own_forward():
    class ZeroCenteredRMSNorm(torch.nn.Module):  # Gemma's and Qwen3-Next's form, under an ordinary name
        def __init__(self, dim):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(dim))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return (1 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    model = torch.nn.Sequential(ZeroCenteredRMSNorm(8), Qwen3RMSNorm(8))
    assert use_fast_rms_norm(model) == 1
    assert "forward" not in model[0].__dict__ and "forward" in model[1].__dict__


def test_seeded_probes_draw_on_the_cpu_under_another_default_device():
    """Lightning sets the accelerator as torch's default device while ``configure_model`` runs: the seeded probes
    (the RMS-norm check, the packing and engine probes' token ids) draw on the CPU all the same and give the same
    answer (a meta default device stands in for CUDA here: a draw there has no data to read)."""
    from rlflow.models import rms_norm
    from rlflow.rollout.engine_support import probe_prompts
    from rlflow.training.packing_support import probe_experiences

    norm = Qwen3RMSNorm(16)  # float32 weights on the CPU, as loaded

    def answers():
        rms_norm._CHECKED.clear()
        return (is_rms_norm(norm), probe_prompts(1000, 4),
                [(e.prompt_ids, e.completion_ids) for e in probe_experiences(1000)])

    plain = answers()
    with torch.device("meta"):
        assert answers() == plain
    assert plain[0] is True
