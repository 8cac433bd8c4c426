"""``model.lora``: PEFT adapters on the policy (rlflow/models/lora.py): settings, merged tensors for lmdeploy,
rollouts, packing, precision, gradient checkpointing (training, the reference and exports through ``rlflow fit``:
``tests/integration/test_lora_fit.py``).

The oracles are independent of rlflow's code: PEFT's own ``merge_and_unload`` (merged tensors for lmdeploy) and a
full forward of the PEFT model (the engine's fused decode and the hf backend).
"""


from __future__ import annotations

import copy

import pytest
import torch

from rlflow.config_error import ConfigError
from rlflow.models.loading import enable_activation_checkpointing
from rlflow.models.lora import LoraSettings, apply_lora, linear_weights, merge_lora_tensors
from tests.helpers.tiny_archs import IdTokenizer, tiny_causal_lm

peft = pytest.importorskip("peft", reason="LoRA needs PEFT: pip install 'rlflow[lora]'")


def random_lora(model: torch.nn.Module, **options) -> object:
    """``model`` with LoRA adapters whose B is random too (PEFT's default B is 0: the adapted model would equal the
    base one and every comparison below would pass trivially)."""
    wrapper = apply_lora(model, LoraSettings(r=4, alpha=8, options={"init_lora_weights": False, **options}))
    return wrapper.eval()


def forward_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    """Log-prob of each next token from one full forward (no rlflow code)."""
    logits = model(input_ids=ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None]).squeeze(2)


# ----------------------------------------------------------------------------------------------- settings
def test_settings_errors_name_the_config_key():
    with pytest.raises(ConfigError, match=r"model\.lora\.r must be an integer >= 1"):
        LoraSettings(r=0)
    with pytest.raises(ConfigError, match=r"model\.lora\.dropout must be in \[0, 1\)"):
        LoraSettings(dropout=1.0)
    with pytest.raises(ConfigError, match=r"model\.lora\.options\.rank_typo is not a field of peft\.LoraConfig"):
        LoraSettings(options={"rank_typo": 3}).peft_config()
    with pytest.raises(ConfigError, match=r"model\.lora\.options\.lora_alpha: set it as model\.lora\.alpha"):
        LoraSettings(options={"lora_alpha": 3}).peft_config()
    with pytest.raises(ConfigError, match="model.lora has no option 'rank'"):
        LoraSettings.coerce({"rank": 4})
    config = LoraSettings(r=8, alpha=4, dropout=0.1, target_modules=["q_proj"], options={"use_rslora": True})
    config = config.peft_config()
    assert (config.r, config.lora_alpha, config.lora_dropout, config.use_rslora) == (8, 4, 0.1, True)
    assert set(config.target_modules) == {"q_proj"}


def test_without_peft_model_lora_says_how_to_install_it(monkeypatch, tiny_model):
    import sys

    from rlflow.training.module import GRPOModule

    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    with pytest.raises(ConfigError, match=r"model\.lora needs the PEFT library: pip install 'rlflow\[lora\]'"):
        GRPOModule(model_path=str(tiny_model), lora={"r": 4})
    assert GRPOModule(model_path=str(tiny_model)).lora is None  # full fine-tuning needs no PEFT


def test_a_peft_that_does_not_import_beside_this_transformers_is_named_with_both_versions(monkeypatch, tmp_path):
    import sys
    from importlib import metadata

    from rlflow.models.lora import require_peft

    fake = tmp_path / "peft"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError(\"cannot import name 'HybridCache' from 'transformers'\")\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "peft", raising=False)
    with pytest.raises(ConfigError) as caught:
        require_peft()
    assert str(caught.value) == (
        f"model.lora: the installed peft {metadata.version('peft')} does not import beside transformers "
        f"{metadata.version('transformers')} (ImportError: cannot import name 'HybridCache' from 'transformers'); "
        "install a peft release that supports it: pip install -U peft")


def test_unknown_target_module_is_a_config_error():
    with pytest.raises(ConfigError, match="model.lora: PEFT cannot adapt"):
        apply_lora(tiny_causal_lm("qwen3"), LoraSettings(target_modules=["no_such_proj"]))


# ------------------------------------------------------------------------------------ engines and merges
@torch.no_grad()
def test_merged_tensors_for_lmdeploy_equal_peft_merge_and_unload():
    model = tiny_causal_lm("llama")
    wrapper = random_lora(model, use_rslora=True)
    expected = copy.deepcopy(wrapper).merge_and_unload().state_dict()
    merged = dict(merge_lora_tensors(model, model.state_dict().items()))
    assert list(merged) == list(expected)  # the plain model's names, in its order
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=1e-6, atol=1e-6, msg=name)
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           model.model.layers[0].self_attn.q_proj.base_layer.weight)  # the adapters moved it
    with wrapper.disable_adapter():  # adapters off: the base weights
        off = dict(merge_lora_tensors(model, model.state_dict().items()))
        down = model.model.layers[0].mlp.down_proj.base_layer.weight
        assert torch.equal(off["model.layers.0.mlp.down_proj.weight"], down)


def test_lmdeploy_push_names_are_the_base_models():
    from rlflow.rollout.lmdeploy import full_named_tensors

    model = tiny_causal_lm("qwen3")
    names = list(model.state_dict())
    random_lora(model)
    pushed = dict(full_named_tensors(model, torch.bfloat16))
    assert list(pushed) == names and all(t.dtype == torch.bfloat16 for t in pushed.values())


@torch.no_grad()
def test_dora_is_not_folded_by_the_fused_decoder():
    from rlflow.rollout.fused import FusedDecoder

    model = tiny_causal_lm("qwen3")
    random_lora(model, use_dora=True)
    assert "variant" in FusedDecoder.unsupported_reason(model)
    with pytest.raises(ValueError, match="variant"):
        linear_weights(model.model.layers[0].self_attn.q_proj)


@torch.no_grad()
@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3-dora"])
def test_engine_fused_decode_samples_from_the_adapted_model(arch):
    """LoRA deltas folded into the fused decoder's copies; DoRA (not a weight delta) through the model's forward."""
    from rlflow.rollout.base import SamplingParams
    from rlflow.rollout.engine import EngineRollout

    model = tiny_causal_lm(arch.split("-")[0])
    base = copy.deepcopy(model)
    wrapper = random_lora(model, use_dora=arch.endswith("dora"))
    engine = EngineRollout()
    engine.bind(model, IdTokenizer())
    if arch.endswith("dora"):
        assert engine.decode_path.startswith("decode through the model's forward") and "variant" in engine.decode_path
    else:
        assert engine.decode_path == "fused decode"  # the LoRA projections are folded, not a fallback
    prompts = [[5, 9, 17, 33, 2], [8, 3, 60]]
    groups = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=10), n=3)
    worst_adapted = worst_base = 0.0
    for prompt, group in zip(prompts, groups):
        for c in group:
            ids = torch.tensor([prompt + c.token_ids])
            width = len(c.token_ids)
            adapted = forward_logprobs(wrapper, ids)[0, -width:]  # a full forward of the PEFT model
            plain = forward_logprobs(base, ids)[0, -width:]
            worst_adapted = max(worst_adapted, float((torch.tensor(c.logprobs) - adapted).abs().max()))
            worst_base = max(worst_base, float((torch.tensor(c.logprobs) - plain).abs().max()))
    assert worst_adapted < 1e-4
    assert worst_base > 1e-2  # the adapters matter: the base model's log-probs are not the rollout's


@torch.no_grad()
def test_hf_backend_generates_with_the_adapters():
    from rlflow.rollout.base import SamplingParams
    from rlflow.rollout.hf import HFRollout

    model = tiny_causal_lm("qwen3")
    wrapper = random_lora(model)
    backend = HFRollout()
    backend.bind(model, IdTokenizer())
    (completion,), = backend.generate([[5, 9, 17, 33]], SamplingParams(temperature=0.0, max_tokens=8))
    ids = torch.tensor([[5, 9, 17, 33]])
    for _ in range(len(completion.token_ids)):  # greedy decoding of the adapted model, token by token
        nxt = wrapper(input_ids=ids).logits[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    assert completion.token_ids == ids[0, 4:].tolist()
    with wrapper.disable_adapter():
        base_next = int(model(input_ids=torch.tensor([[5, 9, 17, 33]])).logits[0, -1].argmax())
    adapted_lp = forward_logprobs(wrapper, ids)[0, -len(completion.token_ids):]
    torch.testing.assert_close(torch.tensor(completion.logprobs), adapted_lp, rtol=0, atol=1e-4)
    assert base_next != completion.token_ids[0] or completion.logprobs[0] != pytest.approx(
        float(torch.log_softmax(model(input_ids=torch.tensor([[5, 9, 17, 33]])).logits[0, -1], -1).max()))


def test_packing_check_passes_on_the_adapted_model():
    from rlflow.training.packing_support import packing_unsupported_reason

    model = tiny_causal_lm("qwen3")
    random_lora(model)
    assert packing_unsupported_reason(model) is None


def test_adapters_are_float32_over_a_bfloat16_base():
    """The recipe's bf16 base keeps fp32 adapters (PEFT's autocast_adapter_dtype), so plain AdamW loses nothing."""
    model = tiny_causal_lm("qwen3").to(torch.bfloat16)
    apply_lora(model, LoraSettings(r=4))
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    assert all(d == torch.float32 for n, d in dtypes.items() if "lora_" in n)
    assert all(d == torch.bfloat16 for n, d in dtypes.items() if "lora_" not in n)


def test_gradient_checkpointing_keeps_the_adapters_gradients():
    """The recipe's gradient checkpointing with a frozen base: the adapters' gradients equal those without it
    (reentrant checkpointing would drop them, as no input of a checkpointed layer requires grad)."""
    grads = []
    for checkpointing in (False, True):
        model = tiny_causal_lm("qwen3")
        if checkpointing:
            enable_activation_checkpointing(model)  # as model.policy.gradient_checkpointing does
        random_lora(model)
        model.train()
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
        forward_logprobs(model, ids).sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name, grad in grads[0].items():
        assert grads[1][name] is not None, name
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-6, msg=name)

