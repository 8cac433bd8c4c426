"""``rlflow.cli.plugin_argument_error``: jsonargparse's union error for a plugin its constructor refused becomes one
line with the plugin's own message, however deep the union nests it. ``lightning_argument_error``: Lightning's
refusals of its arguments are one line; other errors keep their traceback."""

from __future__ import annotations

import pytest

from rlflow.cli import plugin_argument_error

NESTED = """Does not validate against any of the Union subtypes
Subtypes: [<class 'dict'>, <class 'NoneType'>]
Errors:
  - Does not validate against any of the Union subtypes
    Errors:
      - Expected a <class 'str'>
      - data.judging.judgers: the remote judger 'remote' cannot reach http://127.0.0.1:9/x; fix its url
      - Expected a <class 'list'>
  - Expected a <class 'NoneType'>
Given value type: <class 'dict'> class_path='rlflow.judgers.remote.RemoteJudger'"""

FLAT = """Does not validate against any of the Union subtypes
Subtypes: [<class 'str'>, <class 'rlflow.losses.base.PolicyLoss'>]
Errors:
  - Expected a <class 'str'>
  - epsilon_low must be in [0, 1), got 1.5
Given value type: class_path='rlflow.losses.clipped.BNPOLoss'"""


def test_a_nested_plugin_message_is_found():
    line = plugin_argument_error(ValueError(NESTED))
    assert line == ("data.judging.judgers: the remote judger 'remote' cannot reach http://127.0.0.1:9/x; fix its url "
                    "(rlflow.judgers.remote.RemoteJudger)")


def test_a_top_level_plugin_message_names_the_option():
    assert plugin_argument_error(ValueError(FLAT)) == (
        "model.loss (rlflow.losses.clipped.BNPOLoss): epsilon_low must be in [0, 1), got 1.5")


def test_other_errors_are_not_rewritten():
    assert plugin_argument_error(ValueError("something else")) is None
    assert plugin_argument_error(KeyError(NESTED)) is None


def test_only_lightnings_argument_checks_are_its_one_line_refusals():
    from lightning.fabric.utilities.exceptions import MisconfigurationException
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    from rlflow.cli import lightning_argument_error

    assert lightning_argument_error(MisconfigurationException("`max_steps` must be ...")) == "`max_steps` must be ..."
    with pytest.raises(ValueError) as raised:  # raised in Lightning's connector: the user's strategy name
        _AcceleratorConnector(strategy="nonsense")
    assert lightning_argument_error(raised.value).startswith("You selected an invalid strategy name")
    try:
        raise ValueError("a bug of rlflow's own")
    except ValueError as exc:  # raised here, not in Lightning's checks: left to its traceback
        assert lightning_argument_error(exc) is None
