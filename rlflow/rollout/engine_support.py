"""Whether the ``engine`` rollout backend can run a model: static checks of its configuration, then a probe.

Why a probe: the engine's fused forward (:mod:`rlflow.rollout.fused`) covers Qwen2/Qwen3/Llama-style models, and
every other model is decoded through its own forward with the engine's attention function and cache
(:func:`rlflow.rollout.decode_state.shared_prefix_attention`). Whether an architecture's forward honours that protocol
(attention through transformers' attention interface, extra keyword arguments passed down to it,
``cache.update(k, v, layer_idx)`` on the cache it is given) cannot be read from its config, so the engine decodes
two tiny prompts greedily (through the very path :meth:`EngineRollout.stream` will take) and checks each taken
token's log-prob against the model's own full forward. It costs a few forward passes of ~20 tokens, once per model.

Simplifications: the probe is a sanity check, not a proof (a path that is wrong only for long sequences or
batches of many groups would pass it); its tolerance is loose in 16-bit dtypes, where the engine's float32
attention and the model's own kernels round differently.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from rlflow.rollout.base import SamplingParams

PROBE_TOKENS = 3  # generated tokens per probe completion
TOLERANCE = {torch.float32: 2e-2, torch.float64: 1e-6}  # max |engine - forward| log-prob; 16-bit dtypes: 0.5
HALF_TOLERANCE = 0.5


def static_unsupported_reason(model: Any) -> str | None:
    """What in ``model``'s configuration the engine does not implement, or None."""
    config = getattr(model, "config", None)
    if config is None:
        return "the model has no transformers config"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    from rlflow.models.vision import ENGINE_REASON, is_vision_config

    if is_vision_config(config):
        return ENGINE_REASON.format(name=type(model).__name__)
    types = getattr(config, "layer_types", None)
    if types and set(types) != {"full_attention"}:
        return f"the engine supports full-attention decoders only; this model's layer types are {sorted(set(types))}"
    if not types and getattr(config, "sliding_window", None) is not None:
        return f"sliding-window attention (config.sliding_window={config.sliding_window}) is not implemented"
    from rlflow.rollout.fused import FusedDecoder

    fused = FusedDecoder.unsupported_reason(model) is None
    if not fused and not getattr(model, "_supports_attention_backend", False):
        return (f"{type(model).__name__} is not decoded by the fused path and its attention does not go through "
                "transformers' attention interface, which the engine's decode steps replace")
    return None


def probe_prompts(vocab_size: int, head_len: int) -> list[list[int]]:
    """Two prompts of different lengths sharing a ``head_len``-token head (fixed pseudo-random ids)."""
    gen = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab_size, (head_len + 6,), generator=gen, device="cpu").tolist()
    return [ids[: head_len + 2], ids[: head_len] + ids[head_len + 2:]]


@torch.no_grad()
def probe_error(engine: Any, model: Any) -> str | None:
    """Decode two prompts with ``engine`` (bound to ``model``); None if the log-probs agree with a full forward,
    else why not (an exception raised on the way, or the largest log-prob difference).

    Also sets ``engine.decode_path``: ``"fused decode"``, or why decode steps go through the model's forward
    (decided on the unsharded weights, as during a rollout). The probe decodes in the model's own dtype (the
    engine's ``dtype`` option set aside): it checks the decode path, which a lower-precision copy of the weights
    only rounds differently.
    """
    from rlflow.rollout.fused import FusedDecoder
    from rlflow.training.fsdp_units import full_weights

    vocab = model.get_input_embeddings().num_embeddings
    head_len = engine.min_shared_prefix if engine.min_shared_prefix else 0  # exercise the shared-head path too
    prompts = probe_prompts(vocab, head_len)
    params = SamplingParams(temperature=0.0, max_tokens=PROBE_TOKENS)
    device = next(model.parameters()).device
    was_training = model.training
    dtype = getattr(engine, "dtype", "model")
    engine.dtype = "model"
    try:
        with full_weights(model):  # FSDP-sharded: no collectives, as during a rollout
            fused = FusedDecoder.unsupported_reason(model) if engine.fused else "fused=False"
            engine.decode_path = "fused decode" if fused is None else f"decode through the model's forward: {fused}"
            groups = engine.generate(prompts, params, n=2)
            model.eval()
            worst = 0.0
            for prompt, group in zip(prompts, groups):
                for c in group:
                    ids = torch.tensor([prompt + c.token_ids], device=device)
                    logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), dim=-1)
                    want = logp[len(prompt) - 1: -1].gather(1, ids[0, len(prompt):, None])[:, 0].cpu()
                    worst = max(worst, float((want - torch.tensor(c.logprobs)).abs().max()))
    except Exception as exc:  # any failure of the decode path means: not this model
        return f"its forward does not run the engine's decode step ({type(exc).__name__}: {exc})"
    finally:
        model.train(was_training)
        engine.dtype = dtype
    tolerance = TOLERANCE.get(next(model.parameters()).dtype, HALF_TOLERANCE)
    if not worst <= tolerance:
        return f"the engine's log-probs differ from the model's own forward by {worst:.3g} (> {tolerance:g})"
    return None


def cache_kwargs(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """The forward keyword that takes a KV cache: ``cache`` in transformers >= 5.2x (``past_key_values`` is
    deprecated there and goes in 5.40), ``past_key_values`` before."""
    return {"cache": cache} if _forward_takes_cache(type(model)) else {"past_key_values": cache}


@functools.cache
def _forward_takes_cache(cls: type) -> bool:
    return "cache" in inspect.signature(cls.forward).parameters
