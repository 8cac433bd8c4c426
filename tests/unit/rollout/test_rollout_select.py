"""``data.rollout=auto`` (rlflow.rollout.select): the engine where it can run the model, else hf, and why."""


from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlflow.rollout.base import SamplingParams, UnsupportedModelError
from rlflow.rollout.engine import EngineRollout
from rlflow.rollout.hf import HFRollout
from rlflow.rollout.select import resolve_backend
from tests.helpers.tiny_archs import IdTokenizer, tiny_causal_lm


def auto(model, caplog):
    """``resolve_backend("auto", ...)``; returns the backend and the ``rlflow`` log messages about the choice."""
    with caplog.at_level(logging.INFO, logger="rlflow"):
        backend = resolve_backend("auto", model, IdTokenizer())
    return backend, [r.getMessage() for r in caplog.records if "data.rollout=auto" in r.getMessage()]


def test_auto_picks_the_fused_engine_for_the_qwen3_demo_model(tiny_model, tokenizer, caplog):
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    backend, logged = auto(model, caplog)
    assert isinstance(backend, EngineRollout) and backend.model is model
    assert logged == ["data.rollout=auto: using the engine rollout backend for Qwen3ForCausalLM (fused decode)"]


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_auto_picks_the_fused_engine_for_llama_and_qwen3(name, caplog):
    backend, logged = auto(tiny_causal_lm(name), caplog)
    assert isinstance(backend, EngineRollout)
    assert len(logged) == 1 and "engine" in logged[0] and "(fused decode)" in logged[0]


@pytest.mark.parametrize("name", ["gpt2", "mistral"])
def test_auto_picks_the_engine_through_the_model_forward_for_other_decoders(name, caplog):
    """Architectures the fused path does not cover still run the engine: its decode steps go through their forward."""
    model = tiny_causal_lm(name)
    backend, logged = auto(model, caplog)
    assert isinstance(backend, EngineRollout)
    assert len(logged) == 1 and "decode through the model's forward" in logged[0]
    groups = backend.generate([[5, 9, 17], [6, 7]], SamplingParams(max_tokens=5), n=3)
    assert [len(g) for g in groups] == [3, 3] and all(len(c.token_ids) == 5 for g in groups for c in g)


@pytest.mark.parametrize("name, reason", [
    ("mistral-sliding", "sliding-window attention (config.sliding_window=16) is not implemented"),
    ("stablelm", "its attention does not go through transformers' attention interface"),
])
def test_auto_falls_back_to_hf_for_an_unsupported_architecture_and_says_why(name, reason, caplog):
    backend, logged = auto(tiny_causal_lm(name), caplog)
    assert isinstance(backend, HFRollout) and backend.model is not None
    assert len(logged) == 1 and "using the hf rollout backend" in logged[0] and reason in logged[0]
    assert [r.levelname for r in caplog.records if "data.rollout=auto" in r.getMessage()] == ["WARNING"]


def test_auto_falls_back_to_hf_when_the_engine_probe_disagrees_with_the_model(monkeypatch, caplog):
    """A decode path that runs but computes something else (here: perturbed decode logits) is caught by the probe."""
    step = EngineRollout._decode_step
    monkeypatch.setattr(EngineRollout, "_decode_step", lambda self, *a, **k: step(self, *a, **k) + torch.randn(128))
    backend, logged = auto(tiny_causal_lm("llama"), caplog)
    assert isinstance(backend, HFRollout)
    assert len(logged) == 1 and "differ from the model's own forward" in logged[0]


def test_auto_falls_back_to_hf_when_the_engine_probe_raises(monkeypatch, caplog):
    def broken(self, *args, **kwargs):
        raise RuntimeError("no such cache method")

    monkeypatch.setattr(EngineRollout, "_decode_step", broken)
    backend, logged = auto(tiny_causal_lm("qwen3"), caplog)
    assert isinstance(backend, HFRollout)
    assert "does not run the engine's decode step (RuntimeError: no such cache method)" in logged[0]


def test_a_named_backend_is_used_as_named():
    model = tiny_causal_lm("mistral-sliding")
    assert isinstance(resolve_backend("hf", model, IdTokenizer()), HFRollout)
    with pytest.raises(UnsupportedModelError, match="engine rollout backend cannot run this model: sliding-window"):
        resolve_backend("engine", model, IdTokenizer())
    built = HFRollout(batch_size=3)
    assert resolve_backend(built, model, IdTokenizer()) is built and built.model is model


def test_the_engine_checks_a_model_once(monkeypatch):
    """bind() runs at every fit and validation start: the probe must not run again for the same model."""
    import rlflow.rollout.engine as engine_module

    calls = []
    monkeypatch.setattr(engine_module, "probe_error", lambda engine, model: calls.append(model))
    model, other = tiny_causal_lm("qwen3"), tiny_causal_lm("llama")
    engine = EngineRollout()
    for m in (model, model, other, other):
        engine.bind(m, IdTokenizer())
    assert calls == [model, other]


# --------------------------------------------------------------------------------- through the datamodule and CLI
def test_auto_is_the_default_and_the_datamodule_resolves_it_once(tiny_model, tiny_data, monkeypatch, caplog):
    """RolloutDataModule.bind (at fit and at validation start) chooses the backend the first time only."""
    from rlflow.data.datamodule import RolloutDataModule

    dm = RolloutDataModule(train_data_path=str(tiny_data / "train.jsonl"), tokenizer_path=str(tiny_model))
    assert dm.rollout_spec == "auto"
    with caplog.at_level(logging.INFO, logger="rlflow"):
        backend = dm.bind(AutoModelForCausalLM.from_pretrained(tiny_model))
    assert isinstance(backend, EngineRollout) and backend.decode_path == "fused decode"
    assert sum("data.rollout=auto" in r.getMessage() for r in caplog.records) == 1
    other = tiny_causal_lm("qwen3")
    assert dm.bind(other) is backend and backend.model is other

    fallback = RolloutDataModule(train_data_path=str(tiny_data / "train.jsonl"), tokenizer_path=str(tiny_model))
    assert isinstance(fallback.bind(tiny_causal_lm("mistral-sliding")), HFRollout)

