"""The run-watching callbacks of :mod:`rlflow.training.callbacks` not covered elsewhere: :class:`NoSignalWarning`.

What is checked: the warning's streak logic by hand (it fires once when ``patience`` steps in a row had no group with
differing rewards, re-arms after a step with signal, never fires with patience 0 or without the metric), and through
``rlflow fit``: a judger that gives every completion the same reward gets the warning, with the step's figures, and
one whose rewards differ does not.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from conftest import fit_args

from rlflow.cli import cli_main
from rlflow.training.callbacks import NoSignalWarning


def run(callback: NoSignalWarning, fractions: list[float | None], caplog) -> list[int]:
    """Feed one ``frac_reward_zero_std`` per step (None: the metric absent); the steps (1-based) that warned."""
    warned = []
    for step, frac in enumerate(fractions, 1):
        metrics = {} if frac is None else {"frac_reward_zero_std": frac, "reward": 0.0}
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rlflow"):
            callback.on_train_batch_end(None, SimpleNamespace(last_metrics=metrics), None, None, step - 1)
        if any("no learning signal" in r.getMessage() for r in caplog.records):
            warned.append(step)
    return warned


def test_the_streak_by_hand(caplog):
    assert run(NoSignalWarning(patience=2), [1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0], caplog) == [2, 6]
    assert run(NoSignalWarning(patience=3), [1.0, 1.0, 0.75, 1.0, 1.0, None, 1.0], caplog) == [7]  # None: no step
    assert run(NoSignalWarning(patience=1), [0.0, 1.0, 1.0, 0.25, 1.0], caplog) == [2, 5]
    assert run(NoSignalWarning(patience=0), [1.0] * 4, caplog) == []
    with pytest.raises(ValueError, match="no_signal.patience must be >= 0"):
        NoSignalWarning(patience=-1)


def constant_reward(completions, **kwargs):
    return [0.0] * len(completions)


def text_reward(completions, **kwargs):
    """A reward that differs between different completions (the tiny model's samples differ)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(sum(map(ord, t)) % 97) for t in texts]


@pytest.mark.parametrize("judger,warns", [("constant_reward", True), ("text_reward", False)])
def test_fit_warns_when_the_rewards_of_every_group_agree(tiny_model, tiny_data, tmp_path, caplog, judger, warns):
    args = fit_args(tiny_model, tiny_data, tmp_path, f'--data.judgers={{"*": "test_callbacks:{judger}"}}',
                    "--no_signal.patience=2", "--model.export_hf=false", steps=2)
    with caplog.at_level(logging.WARNING, logger="rlflow"):
        cli = cli_main(args)
    messages = [r.getMessage() for r in caplog.records if "no learning signal" in r.getMessage()]
    assert len(messages) == int(warns)
    if warns:
        clipped = 100 * cli.model.last_metrics["completions/clipped_ratio"]
        assert "no learning signal for 2 rollout steps" in messages[0] and "mean reward 0.000" in messages[0]
        assert f"{clipped:.0f}% of completions cut at data.max_tokens" in messages[0]
    else:
        assert cli.model.last_metrics["frac_reward_zero_std"] < 1.0
