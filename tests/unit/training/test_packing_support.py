"""``model.update.packing`` on by default: the fit-start check keeps packs where they are exact, else padded
micro-batches."""

from __future__ import annotations

import contextlib
import inspect
import logging
import re

import pytest

from rlflow.data.experience import Experience
from rlflow.training.module import GRPOModule
from rlflow.training.packing_support import packing_unsupported_reason, resolve_packing
from tests.helpers.tiny_archs import tiny_causal_lm


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
    import rlflow.training.packing as packing

    monkeypatch.setattr(packing, "_varlen_attention", lambda model, batch: contextlib.nullcontext({}))
    reason = packing_unsupported_reason(tiny_causal_lm("qwen3"))
    assert reason and "sequences leak into each other" in reason


def test_packing_is_the_default_and_kept_where_exact(caplog):
    assert inspect.signature(GRPOModule).parameters["update"].default.packing is True
    with caplog.at_level(logging.INFO, logger="rlflow"):
        assert resolve_packing(True, [tiny_causal_lm("qwen3"), None], False, 64) is True
    assert any(
        "model.update.packing: micro-batches are packs of at most 64 tokens" in r.getMessage() for r in caplog.records
    )


def test_an_unsupported_model_falls_back_to_padded_micro_batches_with_the_reason(tiny_model, caplog):
    module = GRPOModule(model_path=str(tiny_model), update={"micro_batch_size": 2, "pack_max_length": 64})
    module.policy = tiny_causal_lm("stablelm")
    assert module.packing  # as configured (the default) until the fit-start check
    with caplog.at_level(logging.INFO, logger="rlflow"):
        module.packing_checked = resolve_packing(True, [module.policy], False, 64)
    warned = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and re.search(
        "model.update.packing: training on padded micro-batches .* because a packed forward", warned[0].getMessage()
    )
    assert not module.packing
    exps = [Experience([5, 6], [7] * n, [0.0] * n, 0.0, 0.0, 0, "stop", 0) for n in (1, 2, 3, 4, 5)]
    assert [len(mb) for mb in module.micro_batches(exps)] == [2, 2, 1]  # micro_batch_size sequences


def test_the_reference_model_is_checked_too():
    assert resolve_packing(True, [tiny_causal_lm("qwen3"), tiny_causal_lm("stablelm")], False, 64) is False


def test_packing_off_is_not_probed(monkeypatch):
    import rlflow.training.packing_support as packing_support

    monkeypatch.setattr(packing_support, "packing_unsupported_reason", lambda *a: pytest.fail("probed"))
    assert resolve_packing(False, [tiny_causal_lm("qwen3")], False, 64) is False


BF16_ROUNDING = 0.0078  # packed vs padded log-probs of the Qwen3-0.6B shape under fsdp2_bf16 on an H100


@pytest.fixture
def rounded_packs(monkeypatch):
    """Packed log-probs off by what bf16 kernels round differently on a GPU (CPU kernels agree to the bit)."""
    import rlflow.training.packing_support as packing_support

    exact = packing_support.packed_completion_logprobs

    def rounded(*args, **kwargs):
        logprobs, rest = exact(*args, **kwargs)
        return logprobs + BF16_ROUNDING, rest

    monkeypatch.setattr(packing_support, "packed_completion_logprobs", rounded)


def test_the_tolerance_follows_the_compute_dtype_not_the_stored_one(rounded_packs):
    """float32 compute: 0.0078 is a leak; the same float32 parameters computing in bf16 (autocast, or FSDP2's
    param_dtype) round that much on their own, and packing stays on."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from rlflow.training.distributed import shard_model

    reason = packing_unsupported_reason(tiny_causal_lm("qwen3"))
    assert reason and "by 0.0078 (> 0.001 in float32): sequences leak" in reason
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert packing_unsupported_reason(tiny_causal_lm("qwen3")) is None

    created = not dist.is_initialized()  # a single-rank group in this process, unless a test left one
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = tiny_causal_lm("qwen3")
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        shard_model(model, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        assert next(model.parameters()).dtype == torch.float32  # stored: float32 shards
        assert packing_unsupported_reason(model, sharded=True) is None
    finally:
        if created:
            dist.destroy_process_group()


def offset_scores(monkeypatch, padded_module, padded_name: str, packed_off: float, alone_off: float) -> list:
    """Packed log-probs moved by ``packed_off`` and a sequence scored alone (padded, batch of one) by ``alone_off``,
    as a real model's bf16 rounding moves them; returns the list of calls, ``("packed", sharded)`` or
    ``("padded", sequences)``."""
    import rlflow.training.packing_support as packing_support

    exact_packed, exact_padded = packing_support.packed_completion_logprobs, getattr(padded_module, padded_name)
    calls = []

    def packed(*args, **kwargs):
        calls.append(("packed", kwargs.get("sharded")))
        out, rest = exact_packed(*args, **kwargs)
        return out + packed_off, rest

    def padded(model, batch, *args, **kwargs):
        calls.append(("padded", len(batch["input_ids"])))
        out, rest = exact_padded(model, batch, *args, **kwargs)
        return (out + alone_off if len(batch["input_ids"]) == 1 else out), rest

    monkeypatch.setattr(packing_support, "packed_completion_logprobs", packed)
    monkeypatch.setattr(padded_module, padded_name, padded)
    return calls


def test_in_16_bits_a_leak_moves_a_sequence_when_the_pack_is_reversed(monkeypatch):
    """Under bf16 compute the leaking layout's gap passes the fixed tolerance's fallback only if order does not
    move any sequence: it does, so packing is refused, naming the order test."""
    import torch

    import rlflow.training.packing as packing

    monkeypatch.setattr(packing, "_varlen_attention", lambda model, batch: contextlib.nullcontext({}))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reason = packing_unsupported_reason(tiny_causal_lm("qwen3"))
    assert reason and "when the pack's order is reversed" in reason and "sequences leak into each other" in reason


@pytest.mark.parametrize("packed_off,accepted", [(0.15, True), (0.25, False)])
def test_in_16_bits_a_gap_within_three_times_the_models_own_rounding_passes(monkeypatch, packed_off, accepted):
    """A real model's log-probs round by more than 0.1 in bf16 in any layout (simulated here: scoring a sequence
    alone moves it by 0.06): packed log-probs 0.15 from the padded ones are within 3 x 0.06 and packing stays on;
    0.25 is not. In float32 the fixed tolerance alone decides."""
    import torch

    import rlflow.training.logprobs as logprobs

    offset_scores(monkeypatch, logprobs, "completion_logprobs", packed_off, 0.06)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reason = packing_unsupported_reason(tiny_causal_lm("qwen3"))
    assert (reason is None) == accepted, reason
    if not accepted:
        assert re.search(r"by 0\.2\d* \(> 0\.1, and > 3x the 0\.06\d* between two padded layouts, in bfloat16",
                         reason)
    assert "(> 0.001 in float32)" in packing_unsupported_reason(tiny_causal_lm("qwen3"))


@pytest.mark.parametrize("packed_off,accepted", [(0.3, True), (0.6, False)])
def test_in_16_bits_where_padded_layouts_agree_to_the_bit_a_bounded_gap_passes(monkeypatch, packed_off, accepted):
    """Where a CPU's 16-bit kernels give each row the same bits in any batch, two padded layouts differ by 0 and
    measure no rounding (simulated: scoring a sequence alone moves nothing); the pack's float32 attention still
    rounds unlike the padded bf16 one: a gap up to 0.5 passes when reversing the pack moves no sequence."""
    import torch

    import rlflow.training.logprobs as logprobs

    offset_scores(monkeypatch, logprobs, "completion_logprobs", packed_off, 0.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reason = packing_unsupported_reason(tiny_causal_lm("qwen3"))
    assert (reason is None) == accepted, reason
    if not accepted:
        assert re.search(r"by 0\.6\d* \(> 0\.1, and > 0\.5 where two padded layouts agree to the bit, in "
                         r"bfloat16\): sequences leak", reason)


def test_the_16_bit_checks_run_on_a_sharded_model(monkeypatch):
    """FSDP2 with a bf16 ``param_dtype``: the order test and the padded layouts' rounding are sharded forwards too
    (collectives on every rank), and a gap within the model's rounding keeps packing on."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    import rlflow.training.distributed as distributed

    calls = offset_scores(monkeypatch, distributed, "sharded_completion_logprobs", 0.15, 0.06)
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = tiny_causal_lm("qwen3")
        distributed.shard_model(model, init_device_mesh("cpu", (dist.get_world_size(),)),
                                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        assert packing_unsupported_reason(model, sharded=True) is None
    finally:
        if created:
            dist.destroy_process_group()
    assert calls.count(("packed", True)) == 2 and ("padded", 1) in calls  # the pack in order, then reversed
