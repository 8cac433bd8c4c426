"""The config checks name the option of every invalid value and accept the defaults (through ``rlflow fit``, one
``rlflow: error:`` line: ``tests/integration/test_config_checks_fit.py``)."""


from __future__ import annotations

import pytest

from rlflow.config_checks import ConfigError, check_data_args, check_model_args
from rlflow.rollout.base import SamplingParams


def test_data_checks_name_the_option_and_accept_the_defaults():
    check_data_args({"max_tokens": 256, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "prompt_repeat_k": 8,
                     "judger_timeout": None, "eval_k": 1, "eval_temperature": 0.0})
    with pytest.raises(ConfigError, match=r"^data.sampling.max_tokens must be >= 1, got 0$"):
        check_data_args({"max_tokens": 0})
    with pytest.raises(ConfigError, match="data.judging.timeout must be > 0"):
        check_data_args({"judger_timeout": 0})
    with pytest.raises(ConfigError, match="data.eval.k=4 with data.eval.temperature=0"):
        check_data_args({"eval_k": 4, "eval_temperature": 0.0})
    with pytest.raises(ConfigError, match="data.sampling.temperature must be >= 0"):
        check_data_args({"temperature": float("nan")})


def test_model_checks_name_the_option_and_accept_the_defaults():
    check_model_args({"lr": 1e-6, "betas": (0.9, 0.999), "epsilon_low": None, "kl_coef": None, "max_grad_norm": None})
    with pytest.raises(ConfigError, match="model.optim.betas must be two numbers in"):
        check_model_args({"betas": (0.9, 1.0)})
    with pytest.raises(ConfigError, match="model.optim.lr_schedule must be one of constant, linear, cosine"):
        check_model_args({"lr_schedule": "step"})
    with pytest.raises(ConfigError, match="model.loss.init_args.kl_coef must be >= 0"):
        check_model_args({"kl_coef": -0.1})


def test_config_error_is_a_value_error_and_sampling_params_raise_it():
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ConfigError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=0)

