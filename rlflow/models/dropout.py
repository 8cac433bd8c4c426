"""Dropout off in the policy (``model.policy.disable_dropout``, on by default; TRL's ``disable_dropout``, off there).

Why: GRPO compares log-probs of the same tokens computed by different forwards: the training forward (train
mode) against the sampler's, the old policy's and the reference's (eval mode, or rlflow's own decode). With
dropout the training forward draws a random sub-network, so the importance ratio and the KL move by noise that
the clip and the penalty then read as a change of policy. Most current LLMs (Qwen, Llama, SmolLM) ship without
dropout; GPT-2, OPT and Phi-style configs have 0.1.

Simplifications: two forms are covered, the ones transformers' models use: ``torch.nn.Dropout`` modules (their
``p``) and attention modules holding a float ``attention_dropout`` read at forward time (Llama-style attention
passes it to SDPA when training). The config is left as it is, so an export keeps the model's own settings.
"""

from __future__ import annotations

import torch


def disable_dropout(model: torch.nn.Module) -> list[str]:
    """Set every dropout probability of ``model`` to 0; the names of those that were not 0 (``name.p`` for a
    ``Dropout`` module, ``name.attention_dropout`` for an attention module)."""
    switched = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p:
            module.p = 0.0
            switched.append(f"{name}.p")
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, float) and rate:
            module.attention_dropout = 0.0
            switched.append(f"{name}.attention_dropout")
    return switched
