"""Through ``rlflow fit``: :class:`~rlflow.training.callbacks.NoSignalWarning` warns when the rewards of every group
agree for ``patience`` steps in a row."""

from __future__ import annotations

import logging

import pytest

from rlflow.cli import cli_main
from tests.helpers.fit import fit_args


@pytest.mark.parametrize("judger,warns", [("constant_reward", True), ("text_reward", False)])
def test_fit_warns_when_the_rewards_of_every_group_agree(tiny_model, tiny_data, tmp_path, caplog, judger, warns):
    args = fit_args(tiny_model, tiny_data, tmp_path,
                    f'--data.judging.judgers={{"*": "tests.unit.training.test_callbacks:{judger}"}}',
                    "--no_signal.patience=2", "--model.export_hf=false", steps=2)
    with caplog.at_level(logging.WARNING, logger="rlflow"):
        cli = cli_main(args)
    messages = [r.getMessage() for r in caplog.records if "no learning signal" in r.getMessage()]
    assert len(messages) == int(warns)
    if warns:
        clipped = 100 * cli.model.last_metrics["completions/clipped_ratio"]
        assert "no learning signal for 2 rollout steps" in messages[0] and "mean reward 0.000" in messages[0]
        assert f"{clipped:.0f}% of completions cut at data.sampling.max_tokens" in messages[0]
    else:
        assert cli.model.last_metrics["frac_reward_zero_std"] < 1.0

