"""``model.packing`` on by default: the fit-start check keeps packs where they are exact, else padded micro-batches."""

from __future__ import annotations

import contextlib
import inspect
import logging

import pytest

from rlflow.data.experience import Experience
from rlflow.data.packing_support import packing_unsupported_reason
from rlflow.module import GRPOModule
from tiny_archs import tiny_causal_lm


@pytest.mark.parametrize("name, attn", [("qwen3", "sdpa"), ("llama", "eager"), ("gpt2", "sdpa"), ("mistral", "sdpa")])
def test_packing_is_exact_for_common_decoders(name, attn):
    assert packing_unsupported_reason(tiny_causal_lm(name, attn_implementation=attn)) is None


def test_packing_is_refused_for_sliding_window_models():
    reason = packing_unsupported_reason(tiny_causal_lm("mistral-sliding"))
    assert reason and "sliding-window" in reason


def test_packing_is_refused_where_the_packed_forward_fails():
    reason = packing_unsupported_reason(tiny_causal_lm("stablelm"))
    assert reason and reason.startswith("a packed forward of this model fails")


def test_packing_is_refused_where_packed_sequences_would_leak_into_each_other(monkeypatch):
    """A model that ignores rlflow's var-len attention (simulated: it is never switched on) attends across the
    shared-prompt layout's sequences; the probe's log-probs then differ from the padded ones."""
    import rlflow.data.packing as packing

    monkeypatch.setattr(packing, "_varlen_attention", lambda model, batch: contextlib.nullcontext({}))
    reason = packing_unsupported_reason(tiny_causal_lm("qwen3"))
    assert reason and "sequences leak into each other" in reason


def module_with(policy, packing: bool = True) -> GRPOModule:
    module = GRPOModule(model_path="unused", packing=packing, micro_batch_size=2, pack_max_length=64)
    module.policy = policy
    return module


def test_packing_is_the_default_and_kept_where_exact(caplog):
    assert inspect.signature(GRPOModule).parameters["packing"].default is True
    module = module_with(tiny_causal_lm("qwen3"))
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        module.packing_checked = module.check_packing()
    assert module.packing
    assert any("model.packing: micro-batches are packs of at most 64 tokens" in r.getMessage() for r in caplog.records)


def test_an_unsupported_model_falls_back_to_padded_micro_batches_with_the_reason():
    module = module_with(tiny_causal_lm("stablelm"))
    with pytest.warns(UserWarning, match="model.packing: training on padded micro-batches .* because a packed forward"):
        module.packing_checked = module.check_packing()
    assert not module.packing
    exps = [Experience([5, 6], [7] * n, [0.0] * n, 0.0, 0.0, 0, "stop", 0) for n in (1, 2, 3, 4, 5)]
    assert [len(mb) for mb in module.micro_batches(exps)] == [2, 2, 1]  # micro_batch_size sequences


def test_packing_off_is_not_probed(monkeypatch):
    import rlflow.module as module_py

    monkeypatch.setattr(module_py, "packing_unsupported_reason", lambda *a: pytest.fail("probed"))
    assert module_with(tiny_causal_lm("qwen3"), packing=False).check_packing() is False
