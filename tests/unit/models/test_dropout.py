"""rlflow/models/dropout.py: ``model.policy.disable_dropout`` makes the policy's train-mode forward the deterministic
eval-mode
one, for both forms of dropout transformers' models use, and GRPOModule applies it at load time by default."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rlflow.models.dropout import disable_dropout
from rlflow.training.module import GRPOModule
from tests.helpers.tiny_archs import CONFIGS, tiny_causal_lm

IDS = torch.arange(3, 19).reshape(2, 8)


def logits(model: torch.nn.Module, train: bool) -> torch.Tensor:
    model.train(train)
    with torch.no_grad():
        return model(IDS).logits


def test_gpt2s_dropout_modules_are_switched_off():
    model = tiny_causal_lm("gpt2")  # GPT-2's config: embedding, attention and residual dropout 0.1
    torch.manual_seed(0)
    assert not torch.equal(logits(model, True), logits(model, True))  # dropout draws differ
    switched = disable_dropout(model)
    assert "transformer.drop.p" in switched and any("attn_dropout" in n for n in switched)
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    assert torch.equal(logits(model, True), logits(model, False))
    assert model.config.attn_pdrop == 0.1  # the config (what an export writes) is left as it is


def test_llama_style_attention_dropout_is_switched_off():
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", **CONFIGS["llama"], attention_dropout=0.5)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config)
    assert not torch.equal(logits(model, True), logits(model, False))
    assert disable_dropout(model) == [f"model.layers.{i}.self_attn.attention_dropout" for i in range(2)]
    assert torch.equal(logits(model, True), logits(model, False))


def test_a_model_without_dropout_is_left_alone():
    model = tiny_causal_lm("qwen3")
    before = logits(model, True)
    assert disable_dropout(model) == []
    assert torch.equal(logits(model, True), before)


@pytest.mark.parametrize("disable", [True, False])
def test_grpo_module_applies_it_at_load_unless_turned_off(tmp_path, disable):
    tiny_causal_lm("gpt2").save_pretrained(tmp_path)
    settings = {} if disable else {"policy": {"disable_dropout": False}}  # on by default
    module = GRPOModule(model_path=str(tmp_path), **settings)
    module.configure_model()
    rates = [m.p for m in module.policy.modules() if isinstance(m, torch.nn.Dropout)]
    assert rates and all(p == (0.0 if disable else 0.1) for p in rates)
    assert module.policy.training


def test_a_lora_adapters_own_dropout_is_kept(tmp_path):
    """``model.lora.dropout`` is the user's explicit choice: the base model's dropout goes, the adapters' stays."""
    from rlflow.models.lora import LoraSettings

    tiny_causal_lm("gpt2").save_pretrained(tmp_path)  # base dropout 0.1
    module = GRPOModule(model_path=str(tmp_path), lora=LoraSettings(r=4, dropout=0.2, target_modules=["c_attn"]))
    module.configure_model()
    rates = {n: m.p for n, m in module.policy.named_modules() if isinstance(m, torch.nn.Dropout)}
    adapters = [p for n, p in rates.items() if "lora" in n]
    assert adapters and all(p == 0.2 for p in adapters)
    assert all(p == 0.0 for n, p in rates.items() if "lora" not in n)
