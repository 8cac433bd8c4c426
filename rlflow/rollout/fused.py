"""A decode step of Qwen2/Qwen3/Llama-style decoders written with plain torch ops over the live weights.

Why: at rollout batch sizes a decode step of a small model is dominated by the framework around the maths, not
by the maths: transformers' forward goes through ~30 modules, output-recording hooks, a cache object and a mask
builder per token. The engine (:mod:`rlflow.rollout.engine`) calls :meth:`FusedDecoder.step` instead: the
same operations in the same order (so the logits agree with the model's forward to float rounding;
``tests/test_fused_decoder.py`` checks it) with q/k/v and gate/up each folded into one matrix product.

Simplifications: only the architectures listed in :data:`SUPPORTED_MODEL_TYPES` (RMSNorm, rotary embeddings from
the model's own ``rotary_emb``, optional q/k RMSNorm as in Qwen3, optional projection biases as in Qwen2,
SwiGLU-style MLP, full attention); weights must be plain tensors on one device (FSDP-sharded DTensors are not,
so the engine falls back to the model's forward there). The folded q/k/v and gate/up matrices are copies made
once per :class:`FusedDecoder`, i.e. once per rollout call: build a new one after every optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' ``LlamaRMSNorm``/``Qwen3RMSNorm``: ``weight * x / sqrt(mean(x^2) + eps)``, computed in float32."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features) for lin in linears])


class _Layer:
    """One decoder layer's weights, with q/k/v and gate/up concatenated."""

    def __init__(self, layer: torch.nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1_w, self.ln1_eps = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.ln2_w, self.ln2_eps = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
        self.qkv_w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        self.qkv_b = _cat_bias(attn.q_proj, attn.k_proj, attn.v_proj)
        self.q_size, self.kv_size = attn.q_proj.out_features, attn.k_proj.out_features
        self.o_w, self.o_b = attn.o_proj.weight, attn.o_proj.bias
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.qk_norm = None  # Qwen3: RMSNorm over each head of q and k; one op over both with a stacked weight
        if q_norm is not None and k_norm is not None and q_norm.variance_epsilon == k_norm.variance_epsilon:
            heads, kv_heads = self.q_size // q_norm.weight.numel(), self.kv_size // k_norm.weight.numel()
            weight = torch.cat([q_norm.weight.expand(heads, -1), k_norm.weight.expand(kv_heads, -1)])
            self.qk_norm = (weight, q_norm.variance_epsilon)
        elif q_norm is not None or k_norm is not None:
            raise ValueError("FusedDecoder: q_norm and k_norm must both exist with one epsilon")
        self.scaling = attn.scaling
        self.gate_up_w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        self.gate_up_b = _cat_bias(mlp.gate_proj, mlp.up_proj)
        self.inter = mlp.gate_proj.out_features
        self.down_w, self.down_b = mlp.down_proj.weight, mlp.down_proj.bias
        self.act = mlp.act_fn


class FusedDecoder:
    """The decode-step forward of a supported decoder over its live weights (see the module docstring)."""

    def __init__(self, model: Any) -> None:
        reason = self.unsupported_reason(model)
        if reason:
            raise ValueError(f"FusedDecoder: {reason}")
        config, inner = model.config, model.model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.embed = inner.embed_tokens.weight
        self.rotary = inner.rotary_emb
        self.layers = [_Layer(layer) for layer in inner.layers]
        self.norm_w, self.norm_eps = inner.norm.weight, inner.norm.variance_epsilon
        self.lm_head_w, self.lm_head_b = model.lm_head.weight, model.lm_head.bias

    @staticmethod
    def unsupported_reason(model: Any) -> str | None:
        """Why ``model`` cannot be decoded by this class, or None when it can."""
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            return f"model type {model_type!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
        if not isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
            return "the model has no plain nn.Linear lm_head"
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover - torch without distributed
            return None
        if any(isinstance(p, DTensor) for p in model.parameters()):
            return "the weights are sharded (DTensor); the model's own forward gathers them"
        return None

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of one decode step.

        Args:
            tokens: ``[rows]`` token fed at this step.
            positions: ``[rows]`` its position id.
            attend: ``attend(layer_idx, q, k, v, scaling) -> [rows, heads * head_dim]`` with ``q``
                ``[rows, heads, 1, dim]`` and ``k``/``v`` ``[rows, kv_heads, 1, dim]`` after RoPE: stores ``k``/``v``
                in the cache and attends.
        """
        rows, heads, kv_heads, dim = tokens.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        h = F.embedding(tokens, self.embed)
        cos, sin = self.rotary(h, positions[:, None])  # [rows, 1, dim]
        for idx, layer in enumerate(self.layers):
            x = _rms_norm(h, layer.ln1_w, layer.ln1_eps)
            qkv = F.linear(x, layer.qkv_w, layer.qkv_b)
            qk = qkv[:, : layer.q_size + layer.kv_size].view(rows, heads + kv_heads, dim)
            v = qkv[:, layer.q_size + layer.kv_size:].view(rows, kv_heads, 1, dim)
            if layer.qk_norm is not None:
                qk = _rms_norm(qk, *layer.qk_norm)
            qk = (qk * cos + _rotate_half(qk) * sin)[:, :, None]  # RoPE on q and k at once
            out = attend(idx, qk[:, :heads], qk[:, heads:], v, layer.scaling)
            h = h + F.linear(out, layer.o_w, layer.o_b)
            x = _rms_norm(h, layer.ln2_w, layer.ln2_eps)
            gate, up = F.linear(x, layer.gate_up_w, layer.gate_up_b).split(layer.inter, dim=-1)
            h = h + F.linear(layer.act(gate) * up, layer.down_w, layer.down_b)
        h = _rms_norm(h, self.norm_w, self.norm_eps)
        return F.linear(h, self.lm_head_w, self.lm_head_b)
