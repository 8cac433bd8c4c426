"""``model.policy.cast_lm_head_to_fp32`` (:mod:`rlflow.models.lm_head`): the head's parameters and product in
float32, in the
model's own forward, rlflow's chunked log-probs (autocast or not) and the engine's bf16 decode; tied embeddings
keep their output dtype; a PEFT adapter on the head is refused. Precision is checked against a float64 product
of the same bf16 hidden states and weights, worked out separately."""

from __future__ import annotations

import copy

import pytest
import torch

from rlflow.config_error import ConfigError
from rlflow.models.lm_head import cast_lm_head_to_fp32, is_fp32_head
from rlflow.rollout.base import SamplingParams
from rlflow.rollout.engine import EngineRollout
from rlflow.training.logprobs import completion_logprobs
from tests.helpers.tiny_archs import IdTokenizer, tiny_causal_lm


def bf16_model(name: str = "qwen3", tied: bool = False, seed: int = 0) -> torch.nn.Module:
    model = tiny_causal_lm(name, seed=seed)
    model.config.tie_word_embeddings = tied
    if tied:  # the embedding matrix is the head's, as in the demo model and SmolLM2
        model.lm_head.weight = model.model.embed_tokens.weight
    else:  # a head of its own, scaled so that its logits are not tiny
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 4.0)
    return model.to(torch.bfloat16)


def batch_of(vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (3, 14), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "completion_ids": ids[:, 6:]}


def exact_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], head_weight: torch.Tensor) -> torch.Tensor:
    """float64 log-softmax of the model's own last hidden states (bf16) times ``head_weight`` (the bf16 values)."""
    width = batch["completion_ids"].shape[1]
    with torch.no_grad():
        hidden = model.model(input_ids=batch["input_ids"]).last_hidden_state[:, -width - 1 : -1]
        logits = hidden.double() @ head_weight.double().t()
    return torch.log_softmax(logits, -1).gather(-1, batch["completion_ids"][..., None])[..., 0]


def test_the_head_computes_in_float32_under_autocast_and_keeps_its_parameters():
    model = bf16_model()
    head = model.lm_head
    weight = head.weight.detach().clone()
    cast_lm_head_to_fp32(model)
    assert model.lm_head is head and is_fp32_head(head) and isinstance(head, torch.nn.Linear)
    assert head.weight.dtype == torch.float32 and torch.equal(head.weight, weight.float())  # exact widening
    assert set(model.state_dict()) == set(bf16_model().state_dict())  # checkpoints keep their keys
    x = torch.randn(5, model.config.hidden_size, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = head(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, x.float() @ weight.float().t(), rtol=1e-6, atol=1e-6)
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if not n.startswith("lm_head"))
    assert is_fp32_head(copy.deepcopy(model).lm_head)  # the class survives a copy (references, benchmarks)


def test_float32_head_logprobs_are_closer_to_the_exact_product_than_bf16_ones():
    """Same bf16 model, same bf16 hidden states: rlflow's chunked log-probs with the bf16 head are off the float64
    product of those values by bf16 rounding; with the float32 head by float32 rounding (orders of magnitude
    less). Under bf16 autocast as well, and with gradients (the recomputing backward)."""
    model = bf16_model(seed=3)
    batch = batch_of(model.config.vocab_size)
    exact = exact_logprobs(model, batch, model.lm_head.weight)
    plain, _ = completion_logprobs(model, batch)
    cast_lm_head_to_fp32(model)
    wide, _ = completion_logprobs(model, batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast, _ = completion_logprobs(model, batch)
    err_plain = (plain.double() - exact).abs().max().item()
    err_wide = (wide.double() - exact).abs().max().item()
    assert err_plain > 1e-4, err_plain  # bf16 logits really are coarse here
    assert err_wide < err_plain / 100, (err_wide, err_plain)
    torch.testing.assert_close(autocast, wide)
    lp, _ = completion_logprobs(model, batch, chunk_size=4)  # several chunks, under autograd
    lp.sum().backward()
    assert model.lm_head.weight.grad.dtype == torch.float32 and model.lm_head.weight.grad.abs().sum() > 0
    torch.testing.assert_close(lp.detach(), wide)


def test_tied_embeddings_become_float32_and_their_output_keeps_the_model_dtype():
    model = bf16_model("llama", tied=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    cast_lm_head_to_fp32(model)
    assert model.model.embed_tokens.weight.dtype == torch.float32  # one parameter
    ids = torch.tensor([[3, 4, 5, 6]])
    assert model.model.embed_tokens(ids).dtype == torch.bfloat16  # the layers still get bf16 activations
    logits = model(input_ids=ids).logits
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


@pytest.mark.parametrize("tied,source", [(False, "bf16 model"), (True, "bf16 model"), (False, "copies")])
def test_the_engine_decodes_in_bf16_with_a_float32_head(tied, source):
    """The fused decoder keeps the head in float32 (its layers in bf16: a bf16 model, or the engine's bf16 copies
    of float32 master weights) and its log-probs match a forward of the bf16 model with that head to bf16
    rounding of the layers."""
    model = bf16_model("qwen3", tied=tied, seed=4)
    if source == "copies":
        model = model.float()  # float32 master weights, decoded through bf16 copies (the engine's dtype option)
    cast_lm_head_to_fp32(model)
    forward = copy.deepcopy(model).to(torch.bfloat16)
    cast_lm_head_to_fp32(forward)  # .to() made the head's weights bf16 again: widened again
    assert forward.lm_head.weight.dtype == torch.float32
    engine = EngineRollout(seed=0, dtype="bfloat16" if source == "copies" else "model")
    engine.bind(model, IdTokenizer())
    prompts = [[5, 9, 13, 2 + i] for i in range(3)]
    groups = engine.generate(prompts, SamplingParams(1.0, max_tokens=6), n=2)
    decoder = engine._kept_decoder[1]
    assert decoder.head_fp32 and decoder.lm_head_w.dtype == torch.float32
    assert decoder.layers[0].qkv_w.dtype == torch.bfloat16
    for prompt, group in zip(prompts, groups):
        for c in group:
            ids = torch.tensor([prompt + c.token_ids])
            with torch.no_grad():
                logits = forward(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
            want = torch.log_softmax(logits, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), want, atol=0.02, rtol=0)


def test_a_lora_adapter_on_the_head_is_refused():
    peft = pytest.importorskip("peft")
    model = tiny_causal_lm("llama")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["lm_head", "q_proj"]))
    with pytest.raises(ConfigError, match="plain nn.Linear LM head.*cast_lm_head_to_fp32=false"):
        cast_lm_head_to_fp32(wrapped.get_base_model())


def test_the_pipelined_generators_copy_keeps_the_float32_head():
    """``data.pipeline.max_staleness`` runs the engine in a process on a copy of the policy: the copy's layers keep the
    policy's dtype (not the float32 of a tied head that comes first), its head is an FP32Linear with the same
    float32 weights, and it pickles (the tied embedding's hook included), as handing it to the process needs."""
    import pickle

    from rlflow.rollout.process import generator_copy

    policy = bf16_model("qwen3", tied=True, seed=5)
    cast_lm_head_to_fp32(policy)
    copy_ = generator_copy(policy)
    assert next(copy_.model.layers.parameters()).dtype == torch.bfloat16
    assert is_fp32_head(copy_.lm_head) and torch.equal(copy_.lm_head.weight, policy.lm_head.weight)
    ids = torch.tensor([[3, 7, 9]])
    with torch.no_grad():
        logits = copy_(input_ids=ids).logits
        assert logits.dtype == torch.float32
        torch.testing.assert_close(pickle.loads(pickle.dumps(copy_))(input_ids=ids).logits, logits, rtol=0, atol=0)
