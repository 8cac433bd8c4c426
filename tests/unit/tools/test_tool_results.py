"""A tool's return value as the text of its message: cut to ``data.multiturn.max_tool_output`` characters (saying
how much) and, where it cannot become text at all (a list that contains itself, a ``__str__`` that raises), a failed
call naming the value's type; under both ``tool_isolation`` settings, the runner serving on."""

from __future__ import annotations

import re

import pytest

from rlflow.config_error import ConfigError
from rlflow.data.settings import MultiTurnSettings
from rlflow.tools.base import ToolCall, ToolRunner, load_tools
from tests.unit.tools import result_tools

ISOLATIONS = ["process", "thread"]


@pytest.fixture(scope="module")
def tools():
    return load_tools([result_tools.huge, result_tools.circular, result_tools.unprintable, result_tools.echo])


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_huge_result_is_cut_to_the_default_bound_saying_how_much(tools, isolation):
    runner = ToolRunner(tools, timeout=30, isolation=isolation)
    cut, small = runner.run([ToolCall("huge", {"n": 5_000_000}), ToolCall("huge", {"n": 10})])
    assert cut.ok and small.ok and small.content == "x" * 10
    notice = f"\n... [truncated {5_000_000 - 4096} characters]"
    assert cut.content == "x" * 4096 + notice  # data.multiturn.max_tool_output's default: 4096 characters
    runner.close()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_result_is_cut_to_max_output(tools, isolation):
    runner = ToolRunner(tools, timeout=30, isolation=isolation, max_output=100)
    cut, exact = runner.run([ToolCall("huge", {"n": 5_000_000}), ToolCall("huge", {"n": 100})])
    assert cut.content == "x" * 100 + "\n... [truncated 4999900 characters]" and exact.content == "x" * 100
    runner.close()


def test_a_worker_sends_back_only_the_cut_text(tools):
    runner = ToolRunner(tools, timeout=30, max_output=100)
    pool = runner.pool("huge")
    assert pool is not None  # the tool runs in a worker process
    outcome = pool.call((None, 100), {"n": 5_000_000}, 30)  # what comes through the pipe
    assert outcome.error is None and outcome.value == ("x" * 100 + "\n... [truncated 4999900 characters]", None)
    runner.close()


@pytest.mark.parametrize("isolation", ISOLATIONS)
def test_a_value_that_cannot_become_text_is_a_failed_call_and_the_runner_serves_on(tools, isolation):
    runner = ToolRunner(tools, timeout=30, isolation=isolation)
    assert (runner.pool("circular") is None) == (isolation == "thread")
    circular, unprintable = runner.run([ToolCall("circular", {"x": 1}), ToolCall("unprintable", {"x": 1})])
    assert (circular.ok, circular.failure, unprintable.ok, unprintable.failure) == (False, "bad_result", False,
                                                                                    "bad_result")
    assert circular.content == ("Error: tool 'circular' returned a list that cannot be turned into text "
                                "(ValueError: Circular reference detected)")
    assert unprintable.content == ("Error: tool 'unprintable' returned a Unprintable that cannot be turned into text "
                                   "(RuntimeError: no text for you)")
    assert runner.run([ToolCall("echo", {"x": 7})])[0].content == "7"  # the next call works
    runner.close()


@pytest.mark.parametrize("value", [0, -5, 2.5, True, "4096", None])
def test_max_tool_output_must_be_a_positive_whole_number(value):
    with pytest.raises(ConfigError) as info:
        MultiTurnSettings(max_tool_output=value)
    assert str(info.value) == ("data.multiturn.max_tool_output must be a whole number of characters >= 1, got "
                               f"{value!r}")
    with pytest.raises(ValueError, match=re.escape("data.multiturn.max_tool_output must be a whole number")):
        ToolRunner({}, max_output=value)
    assert MultiTurnSettings(max_tool_output=1).max_tool_output == 1 and MultiTurnSettings().max_tool_output == 4096


def test_what_a_worker_sends_back_is_bounded_again_in_the_trainer():
    from rlflow.tools.base import _from_worker

    assert _from_worker(("x" * 10_000, None), 100).text == "x" * 100 + "\n... [truncated 9900 characters]"
    assert _from_worker(["ok", None], 100).text == "ok"  # as a list too
    assert _from_worker(("", "a list that cannot be turned into text"), 100).error.startswith("a list")
    assert _from_worker({"not": "a pair"}, 100).text == '{"not": "a pair"}'
