"""Tiny random-init causal LMs of several architectures, built from a transformers config (no download)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

DECODER = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {
    "llama": DECODER,
    "qwen3": dict(DECODER, head_dim=8),
    "mistral": dict(DECODER, sliding_window=None),  # Mistral-7B-v0.2 and later: full attention
    "mistral-sliding": dict(DECODER, sliding_window=16),
    "gpt2": dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=256),
    "stablelm": DECODER,  # its attention does not go through transformers' attention interface
}


def tiny_causal_lm(name: str, seed: int = 0, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A 2-layer model of architecture ``name`` (a key of :data:`CONFIGS`), in eval mode."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(name.split("-")[0], **CONFIGS[name])
    config._attn_implementation = attn_implementation
    return AutoModelForCausalLM.from_config(config).eval()


class IdTokenizer:
    """What a rollout backend reads from a tokenizer: the pad and EOS ids."""

    pad_token_id = 0
    eos_token_id = 1
