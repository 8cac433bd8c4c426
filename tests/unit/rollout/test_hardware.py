"""``rlflow.rollout.hardware.without_cudnn_attention``: cuDNN's attention kernel is off inside on a CUDA device, as it
was outside afterwards (also after an error), untouched elsewhere. The engine's decode steps and prefills run inside
it (each step of the serve loop, between two yields); ``tests/integration/test_gpu.py`` checks on a GPU that no
cuDNN attention kernel runs during a rollout."""

from __future__ import annotations

import pytest
import torch

from rlflow.rollout.hardware import without_cudnn_attention

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def cudnn_flag():
    """The process-wide flag as the test found it, put back after it."""
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


def test_cudnn_attention_is_off_inside_on_cuda_and_back_on_after():
    torch.backends.cuda.enable_cudnn_sdp(True)
    with without_cudnn_attention(CUDA):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_the_flag_comes_back_after_an_error_inside():
    torch.backends.cuda.enable_cudnn_sdp(True)
    with pytest.raises(KeyError), without_cudnn_attention(CUDA):
        raise KeyError("boom")
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_a_flag_switched_off_by_the_user_stays_off():
    torch.backends.cuda.enable_cudnn_sdp(False)
    with without_cudnn_attention(CUDA):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert not torch.backends.cuda.cudnn_sdp_enabled()


def test_other_devices_leave_the_flag_alone():
    torch.backends.cuda.enable_cudnn_sdp(True)
    with without_cudnn_attention(torch.device("cpu")):
        assert torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_the_engine_decodes_and_prefills_inside_it(monkeypatch):
    """Every SDPA call of a rollout happens with the flag off, where the engine's device were CUDA (the device type
    is what the switch looks at; the arithmetic stays on the CPU)."""
    from rlflow.rollout import engine as engine_module
    from rlflow.rollout import serving
    from rlflow.rollout.base import SamplingParams
    from tests.helpers.tiny_archs import IdTokenizer, tiny_causal_lm
    from tests.unit.rollout.test_engine import prompts_of

    seen = []
    real_switch, real_sdpa = serving.without_cudnn_attention, torch.nn.functional.scaled_dot_product_attention

    def as_if_cuda(device):
        return real_switch(CUDA)

    def sdpa(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real_sdpa(*args, **kwargs)

    torch.backends.cuda.enable_cudnn_sdp(True)
    monkeypatch.setattr(serving, "without_cudnn_attention", as_if_cuda)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    model = tiny_causal_lm("qwen3", seed=1).to(torch.bfloat16)
    engine = engine_module.EngineRollout(seed=0, dtype="model")
    engine.bind(model, IdTokenizer())
    seen.clear()
    between = []  # the caller's code between two groups of the stream: its own kernels
    for _ in engine.stream(prompts_of([11, 17, 8], seed=2), SamplingParams(1.0, max_tokens=6), n=2):
        between.append(torch.backends.cuda.cudnn_sdp_enabled())
    assert seen and not any(seen)  # bf16 caches: the decode attention is one SDPA call per layer, the prefill too
    assert between == [True] * 3 and torch.backends.cuda.cudnn_sdp_enabled()
