"""The config checks name the option of every invalid value and accept the defaults (through ``rlflow fit``, one
``rlflow: error:`` line: ``tests/integration/test_config_checks_fit.py``). Each settings group checks its own fields
(``tests/unit/data/test_settings.py``, ``tests/unit/training/test_settings.py``)."""


from __future__ import annotations

import pytest

from rlflow.config_checks import ConfigError, check_data_args, check_multiturn_images
from rlflow.rollout.base import SamplingParams


def test_data_checks_name_the_option_and_accept_the_defaults():
    check_data_args({"prompt_repeat_k": 8, "global_batch_size": 16, "max_prompt_length": 512})
    with pytest.raises(ConfigError, match=r"^data.prompt_repeat_k must be >= 2, got 1: GRPO compares"):
        check_data_args({"prompt_repeat_k": 1})
    with pytest.raises(ConfigError, match=r"^data.global_batch_size must be >= 1, got 0$"):
        check_data_args({"global_batch_size": 0})
    with pytest.raises(ConfigError, match=r"^data.max_prompt_length must be >= 1, got nan$"):
        check_data_args({"max_prompt_length": float("nan")})


def test_config_error_is_a_value_error_and_sampling_params_raise_it():
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ConfigError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=0)


def test_prompts_with_images_are_not_rolled_out_multi_turn():
    check_multiturn_images(images=True, multiturn=False)
    check_multiturn_images(images=False, multiturn=True)
    with pytest.raises(ConfigError, match=r"^prompts with images are not rolled out multi-turn: data.multiturn.tools, "
                                          r"data.multiturn.environment and .* without the images; unset them"):
        check_multiturn_images(images=True, multiturn=True)


def test_the_batch_split_over_ranks_and_optimizer_steps_is_checked_before_anything_starts():
    from rlflow.config_checks import check_batch_split

    check_batch_split(4, 4, 16, 1)  # one completion per optimizer step at most
    check_batch_split(4, 4, 8, 2)
    with pytest.raises(ConfigError, match=r"^data.global_batch_size=3 must be a multiple of the 2 ranks"):
        check_batch_split(3, 4, 1, 2)
    with pytest.raises(ConfigError, match=r"^model.update.optimizer_steps=17 needs at least one completion per "
                                          r"optimizer step, and a rollout step gives 16 \(data.global_batch_size=4 x "
                                          r"data.prompt_repeat_k=4\); lower it to at most 16$"):
        check_batch_split(4, 4, 17, 1)
    with pytest.raises(ConfigError, match=r"gives 8 \(data.global_batch_size=4 / 2 ranks x data.prompt_repeat_k=4\)"):
        check_batch_split(4, 4, 9, 2)


def test_fit_refuses_more_optimizer_steps_than_completions_in_one_line(tiny_model, tiny_data, tmp_path, capsys):
    from rlflow.cli import main
    from tests.helpers.fit import fit_args

    code = main(fit_args(tiny_model, tiny_data, tmp_path, "--model.update.optimizer_steps=17"))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlflow: ")]
    assert code == 1 and lines == ["rlflow: error: model.update.optimizer_steps=17 needs at least one completion per "
                                   "optimizer step, and a rollout step gives 16 (data.global_batch_size=4 x "
                                   "data.prompt_repeat_k=4); lower it to at most 16"]
    assert not list(tmp_path.rglob("*.ckpt"))  # refused before anything ran
