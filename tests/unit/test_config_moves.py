"""A key of the old flat layout fails with one line naming where it was found and its new place."""

from __future__ import annotations

import pytest

from rlflow import config_moves
from rlflow.cli import main
from rlflow.config_error import ConfigError


def test_every_moved_key_names_a_place_that_exists_in_the_new_signatures():
    import dataclasses
    import inspect

    from rlflow.data.datamodule import RolloutDataModule
    from rlflow.training.module import GRPOModule

    for section, cls in (("data", RolloutDataModule), ("model", GRPOModule)):
        params = inspect.signature(cls.__init__).parameters
        for old in config_moves.MOVED[section]:
            assert old not in params, f"{section}.{old} is still a top-level argument"
            new = config_moves.new_place(section, old).split(".")
            if new[1] == "loss" or new[0] != section:
                continue
            group = params[new[1]].default
            assert new[2] in {f.name for f in dataclasses.fields(group)}, f"{section}.{old} -> {'.'.join(new)}"


@pytest.mark.parametrize(("arg", "new"), [
    ("--data.max_tokens=32", "data.sampling.max_tokens"),
    ("--data.judgers", "data.judging.judgers"),
    ("--model.lr=1e-4", "model.optim.lr"),
    ("--model.kl_coef=0.1", "model.loss.init_args.kl_coef"),
    ("--model.temperature=0.5", "data.sampling.temperature"),
])
def test_an_old_key_on_the_command_line_is_one_error(arg, new):
    with pytest.raises(ConfigError) as err:
        config_moves.check_argv(["fit", arg, "1"])
    assert str(err.value).startswith("command line: ") and f"is now {new} " in str(err.value)


def test_new_keys_and_other_options_pass():
    config_moves.check_argv(["fit", "--data.sampling.max_tokens=3", "--model.optim.lr", "1e-4", "--trainer.max_steps",
                             "2", "--data.train_data_path", "x.jsonl", "--model.loss.kl_coef", "0.1"])


def test_an_old_key_in_a_config_file_names_the_file_and_line(tmp_path):
    config = tmp_path / "old.yaml"
    config.write_text("trainer:\n  max_steps: 2\nmodel:\n  model_path: m\n  optim:\n    lr: 1.0e-4\n"
                      "data:\n  train_data_path: t.jsonl\n  prompt_repeat_k: 4\n  eval_k: 2\n")
    with pytest.raises(ConfigError, match=rf"^{config}, line 10: data\.eval_k is now data\.eval\.k "):
        config_moves.check_argv(["fit", "--config", str(config)])
    nested = tmp_path / "fit.yaml"
    nested.write_text("fit:\n  model:\n    micro_batch_size: 4\n")
    with pytest.raises(ConfigError, match=r"line 3: model\.micro_batch_size is now model\.update\.micro_batch_size"):
        config_moves.check_argv(["fit", f"--config={nested}"])


def test_rlflow_fit_prints_one_error_line_for_an_old_key(tmp_path, capsys):
    config = tmp_path / "old.yaml"
    config.write_text("data:\n  train_data_path: t.jsonl\n  max_tokens: 16\n")
    assert main(["fit", "--config", str(config)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == (f"rlflow: error: {config}, line 3: data.max_tokens is now data.sampling.max_tokens "
                      "(settings are grouped; see the guide's configuration reference)")
    assert len(err) == 2 and "RLFLOW_TRACEBACK" in err[1]
