"""The benchmarks' ``model.generate`` anchor: :class:`PlainGenerateRollout`.

rlflow's ``hf`` backend (:class:`rlflow.rollout.hf.HFRollout`) samples with per-row counter-based draws, so a row's
tokens do not depend on its batch. What a user of ``generate`` gets is transformers' own sampler instead: its
temperature, top-k, top-p and min-p warpers and torch's global generator. ``bench_rollout.py`` and ``bench_flops.py``
time rlflow's engine against that, so the anchor is the ``hf`` backend with its sampling processors swapped for
``generate``'s own settings; prompts, batching and the log-probs are the ``hf`` backend's.
"""

from __future__ import annotations

from typing import Any

from transformers import GenerationConfig, LogitsProcessorList

from rlflow.rollout.base import SamplingParams
from rlflow.rollout.hf import HFRollout
from rlflow.rollout.requests import DecodeRequest


def generate_settings(params: SamplingParams) -> dict[str, Any]:
    """The ``GenerationConfig`` fields with which transformers' own sampler draws as ``params`` asks: ``do_sample``
    with its temperature/top-k/top-p/min-p warpers (none when greedy), and its repetition penalty where one is set
    (transformers' processor also counts the left padding)."""
    settings: dict[str, Any] = {} if params.greedy else {
        "do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
        "min_p": params.min_p or None}
    if params.repetition_penalty != 1.0:
        settings["repetition_penalty"] = params.repetition_penalty
    return settings


class PlainGenerateRollout(HFRollout):
    """``model.generate`` with transformers' own sampler (``do_sample`` with its temperature/top-k/top-p/min-p
    warpers, torch's global generator): the benchmarks' anchor, what a user of ``generate`` gets. Not a registered
    backend: its samples depend on the batch composition."""

    def sampling_processors(self, params: SamplingParams, rows: list[tuple[DecodeRequest, int]],
                            config: GenerationConfig) -> LogitsProcessorList:
        for name, value in generate_settings(params).items():
            setattr(config, name, value)
        return LogitsProcessorList()
