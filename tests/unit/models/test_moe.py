"""``model.policy.router_aux_loss_coef`` (:mod:`rlflow.models.moe`): an MoE policy's load-balancing loss, caught from
rlflow's
own log-prob forward, equals transformers' ``aux_loss`` of the same batch; the coefficient defaults to the config's
and is refused for dense models."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlflow.config_error import ConfigError
from rlflow.models.moe import collect_router_logits, router_aux_coef
from rlflow.training.logprobs import completion_logprobs
from tests.helpers.tiny_archs import tiny_causal_lm

MOE = dict(
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=256,
)


def tiny_moe(vocab: int = 64, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", vocab_size=vocab, **MOE))


def test_the_caught_aux_loss_is_transformers_own():
    model = tiny_moe()
    ids = torch.randint(2, 64, (3, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # a left-padded row: its padding is left out of the expert statistics
    batch = {"input_ids": ids, "attention_mask": mask, "completion_ids": ids[:, 6:]}
    with collect_router_logits(model) as caught:
        completion_logprobs(model, batch)
    assert model.config.output_router_logits is False  # restored
    want = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
    got = caught.aux_loss()
    torch.testing.assert_close(got, want)
    assert got.requires_grad  # it trains the routers
    unmasked = model(input_ids=ids, output_router_logits=True).aux_loss
    assert not torch.allclose(got, unmasked)  # the mask mattered


def test_the_aux_loss_is_found_through_a_wrapper_subclass():
    """FSDP2's ``fully_shard`` swaps the model's class for a subclass defined in torch: the architecture's loss
    function is still found (through the class's MRO), so a sharded policy keeps its load-balancing loss."""
    model = tiny_moe()
    model.__class__ = type("FSDPQwen3MoeForCausalLM", (type(model),), {"__module__": "torch.distributed.fsdp"})
    ids = torch.randint(2, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    with collect_router_logits(model) as caught:
        completion_logprobs(
            model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_ids": ids[:, 4:]}
        )
    torch.testing.assert_close(caught.aux_loss(), model(input_ids=ids, output_router_logits=True).aux_loss)


def test_the_coefficient_defaults_to_the_config_and_is_refused_for_dense_models():
    model = tiny_moe()
    assert router_aux_coef(model, None) == model.config.router_aux_loss_coef == 0.001
    assert router_aux_coef(model, 0.0) == 0.0 and router_aux_coef(model, 0.02) == 0.02
    dense = tiny_causal_lm("llama")
    assert router_aux_coef(dense, None) == 0.0
    with pytest.raises(ConfigError, match="not a mixture-of-experts model"):
        router_aux_coef(dense, 0.01)
    with collect_router_logits(dense) as caught:  # nothing to catch: no hook, zero loss
        dense(torch.tensor([[3, 4, 5]]))
    assert float(caught.aux_loss()) == 0.0
