"""``data.*`` settings groups: each checks its own values, naming the full key; mappings become the dataclass."""

from __future__ import annotations

import pytest

from rlflow.config_error import ConfigError
from rlflow.data.settings import (
    EvalSettings,
    FilteringSettings,
    JudgingSettings,
    MultiTurnSettings,
    PipelineSettings,
    PromptSettings,
)
from rlflow.rollout.base import SamplingSettings


@pytest.mark.parametrize(("cls", "field", "value", "key"), [
    (SamplingSettings, "max_tokens", 0, "data.sampling.max_tokens"),
    (SamplingSettings, "temperature", -0.5, "data.sampling.temperature"),
    (SamplingSettings, "top_p", 0.0, "data.sampling.top_p"),
    (SamplingSettings, "top_p", 1.5, "data.sampling.top_p"),
    (SamplingSettings, "top_k", -1, "data.sampling.top_k"),
    (SamplingSettings, "min_p", 1.0, "data.sampling.min_p"),
    (SamplingSettings, "repetition_penalty", 0.0, "data.sampling.repetition_penalty"),
    (EvalSettings, "batch_size", 0, "data.eval.batch_size"),
    (EvalSettings, "k", 0, "data.eval.k"),
    (JudgingSettings, "timeout", 0.0, "data.judging.timeout"),
    (FilteringSettings, "max_rounds", 0, "data.filtering.max_rounds"),
    (PipelineSettings, "max_staleness", -1, "data.pipeline.max_staleness"),
    (PipelineSettings, "stale_policy", "keep", "data.pipeline.stale_policy"),
    (PipelineSettings, "generator_threads", 0, "data.pipeline.generator_threads"),
    (MultiTurnSettings, "max_turns", 0, "data.multiturn.max_turns"),
    (MultiTurnSettings, "tool_timeout", -1.0, "data.multiturn.tool_timeout"),
])
def test_each_group_refuses_a_bad_value_naming_its_full_key(cls, field, value, key):
    with pytest.raises(ConfigError, match=rf"^{key.replace('.', chr(92) + '.')}"):
        cls(**{field: value})


def test_defaults_are_valid_and_the_boundaries_accepted():
    for cls in (SamplingSettings, EvalSettings, JudgingSettings, FilteringSettings, PipelineSettings,
                MultiTurnSettings, PromptSettings):
        cls()
    SamplingSettings(temperature=0.0, top_p=1.0, min_p=0.0, max_tokens=1)
    JudgingSettings(timeout=None)
    MultiTurnSettings(tool_timeout=None)


def test_eval_k_above_one_needs_sampling():
    with pytest.raises(ConfigError, match=r"data\.eval\.k=4 with data\.eval\.temperature=0"):
        EvalSettings(k=4)
    assert EvalSettings(k=4, temperature=0.6).k == 4


def test_sampling_settings_become_the_backends_params_with_stop_ids():
    params = SamplingSettings(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, repetition_penalty=1.2,
                              max_tokens=12).params([3, 4])
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty,
            params.max_tokens, params.stop_token_ids) == (0.7, 0.9, 5, 0.1, 1.2, 12, [3, 4])


def test_coerce_takes_the_dataclass_a_mapping_or_none():
    given = SamplingSettings(max_tokens=8)
    assert SamplingSettings.coerce(given) is given
    assert SamplingSettings.coerce({"max_tokens": 9}).max_tokens == 9
    assert SamplingSettings.coerce(None) == SamplingSettings()
    with pytest.raises(ConfigError, match=r"data\.sampling has no option 'max_new_tokens'; its options are "):
        SamplingSettings.coerce({"max_new_tokens": 9})
    with pytest.raises(ConfigError, match="data.eval must be a mapping of EvalSettings fields, got int"):
        EvalSettings.coerce(3)


def test_multiturn_is_enabled_by_tools_or_an_environment():
    assert not MultiTurnSettings().enabled
    assert MultiTurnSettings(tools=["calculator"]).enabled
    assert MultiTurnSettings(environment="my.env:Env").enabled


def test_judging_defaults_to_the_gsm8k_judger():
    assert JudgingSettings().judger_specs() == {"openai/gsm8k": "gsm8k"}
    assert JudgingSettings(judgers={"*": "math"}).judger_specs() == {"*": "math"}
