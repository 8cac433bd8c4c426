"""rlflow.rollout.fused: the engine's own decode-step forward equals the transformers model's forward."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from rlflow.rollout.engine import cache_kwargs
from rlflow.rollout.fused import FusedDecoder

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "qwen3":  # q/k RMSNorm, explicit head_dim different from hidden / heads
        model = Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=24, tie_word_embeddings=True))
    elif kind == "qwen2":  # q/k/v biases
        model = Qwen2ForCausalLM(Qwen2Config(**SMALL))
    elif kind == "llama":  # biases everywhere, untied lm_head, scaled rope
        model = LlamaForCausalLM(LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
                                             rope_parameters={"rope_type": "default", "rope_theta": 500.0}))
    else:  # rotary frequencies that depend on the sequence length: no cos/sin table, the model's rotary per step
        model = LlamaForCausalLM(LlamaConfig(**SMALL, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                      "rope_theta": 500.0}))
    for p in model.parameters():  # random biases and norms, not the zeros/ones of the initialisation
        torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def plain_attend(cache: DynamicCache, num_heads: int):
    """Attention written from its definition over the cached keys plus the step's key (no engine code)."""

    def attend(layer: int, q, k, v, scaling):
        keys = torch.cat([cache.layers[layer].keys, k], dim=2)  # [rows, kv, T, d]
        values = torch.cat([cache.layers[layer].values, v], dim=2)
        rep = num_heads // keys.shape[1]
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
        weights = torch.softmax((q @ keys.transpose(-1, -2)) * scaling, dim=-1)
        return (weights @ values).reshape(q.shape[0], -1)

    return attend


@pytest.mark.parametrize("kind", ["qwen3", "qwen2", "llama", "llama-dynamic-rope"])
@torch.no_grad()
def test_decode_step_logits_equal_the_model_forward(kind):
    model = build(kind)
    assert FusedDecoder(model).rope_table == (kind != "llama-dynamic-rope")
    ids = torch.randint(0, 97, (3, 12), generator=torch.Generator().manual_seed(1))
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :-1], use_cache=True, **cache_kwargs(model, cache))
    decoder = FusedDecoder(model)
    logits = decoder.step(ids[:, -1], torch.full((3,), 11), plain_attend(cache, model.config.num_attention_heads))
    torch.testing.assert_close(logits, model(ids).logits[:, -1], atol=1e-4, rtol=1e-4)


def test_the_folded_weights_follow_the_live_model_when_rebuilt():
    model = build("qwen3")
    ids = torch.randint(0, 97, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)  # an optimizer step between two rollouts
        cache = DynamicCache(config=model.config)
        model(input_ids=ids[:, :-1], use_cache=True, **cache_kwargs(model, cache))
        logits = FusedDecoder(model).step(ids[:, -1], torch.full((2,), 5), plain_attend(cache, 4))
        torch.testing.assert_close(logits, model(ids).logits[:, -1], atol=1e-4, rtol=1e-4)


def test_unsupported_models_are_named_with_the_reason():
    class Other(torch.nn.Module):
        config = type("C", (), {"model_type": "gpt2"})()

    assert "gpt2" in FusedDecoder.unsupported_reason(Other())
    with pytest.raises(ValueError, match="not one of qwen2, qwen3, llama"):
        FusedDecoder(Other())
    assert FusedDecoder.unsupported_reason(build("qwen2")) is None
