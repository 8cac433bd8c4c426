"""``data.rollout`` through ``rlflow fit``: ``auto`` is accepted and the default, and a named engine that cannot run
the model is one error line."""

from __future__ import annotations

from rlflow.rollout.base import UnsupportedModelError
from tests.helpers.tiny_archs import tiny_causal_lm


def test_the_cli_accepts_auto_and_defaults_to_it(tiny_model, tiny_data, tmp_path):
    from rlflow.cli import cli_main
    from tests.helpers.fit import fit_args

    for extra in ([], ["--data.rollout=auto"]):
        cli = cli_main(fit_args(tiny_model, tiny_data, tmp_path, *extra)[1:], run=False)
        assert cli.datamodule.rollout_spec == "auto" and cli.model.settings.update.packing is True


def test_a_named_engine_that_cannot_run_the_model_is_one_error_line(tiny_model, tiny_data, tmp_path, capsys):
    from transformers import AutoTokenizer

    from rlflow.cli import main
    from rlflow.config_error import ConfigError
    from tests.helpers.fit import fit_args

    assert issubclass(UnsupportedModelError, ConfigError)
    model_dir = tmp_path / "sliding"
    tiny_causal_lm("mistral-sliding").save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(tiny_model).save_pretrained(model_dir)
    code = main(fit_args(model_dir, tiny_data, tmp_path, "--data.rollout=engine", steps=1))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("rlflow: error:")]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert "the engine rollout backend cannot run this model: sliding-window attention" in lines[0]

