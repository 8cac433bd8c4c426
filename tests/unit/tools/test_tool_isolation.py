"""A user's plain tools in worker processes (``data.multiturn.tool_isolation: process``, the default): a hung call is
killed with what it started and the next call gets a fresh worker, a crash is a tool message, a result travels back
as its text (made in the worker), and rlflow's own and ``async`` tools stay in the trainer. The hostile tools are in
:mod:`tests.helpers.hostile`."""

from __future__ import annotations

import os
import threading

import pytest

from rlflow.tools.base import ToolCall, ToolRunner, load_tools
from tests.helpers import hostile
from tests.helpers.multiturn_helpers import add
from tests.unit.tools.test_tool_failures import remaining_async


def test_a_hung_tool_call_is_killed_with_what_it_started_and_the_next_call_gets_a_fresh_worker(tmp_path):
    pidfile = tmp_path / "pids"
    runner = ToolRunner(load_tools([hostile.sleepy_tool, hostile.pid_tool]), timeout=1.0)
    nap = ToolCall("sleepy_tool", {"seconds": 0, "pidfile": str(pidfile)})
    assert runner.run([nap])[0].content == "woke up"
    threads = threading.active_count()
    hung, other = runner.run([ToolCall("sleepy_tool", {"seconds": 10_000, "pidfile": str(pidfile)}),
                              ToolCall("pid_tool", {"x": 0})])
    assert (hung.failure, hung.content) == ("timeout", "Error: tool 'sleepy_tool' timed out after 1.0 s")
    assert other.ok and int(other.content) != os.getpid()
    first_worker, first_child, worker, child = hostile.read_pids(pidfile)
    assert worker == first_worker and hostile.all_gone([worker, child])
    assert runner.run([nap])[0].content == "woke up"
    fresh, fresh_child = hostile.read_pids(pidfile)[-2:]
    assert fresh != worker and hostile.threads_at_most(threads), threading.enumerate()
    runner.close()  # the idle workers end, and the processes they left running
    assert hostile.all_gone([first_child, fresh, fresh_child])


def test_a_crash_is_a_tool_message_and_a_value_that_cannot_be_pickled_travels_as_its_text():
    runner = ToolRunner(load_tools([hostile.crashing_tool, hostile.lambda_tool, add]), timeout=20)
    crashed, unpicklable, fine = runner.run([ToolCall("crashing_tool", {"code": 9}), ToolCall("lambda_tool", {"x": 1}),
                                             ToolCall("add", {"a": 1, "b": 2})])
    assert (crashed.failure, unpicklable.ok, fine.content) == ("crashed", True, "3")
    assert crashed.content == ("Error: tool 'crashing_tool' crashed: the worker process of tool 'crashing_tool' "
                               "exited with code 9 during the call; a new one serves the next call")
    # the worker turns the value into text (what tool_isolation: thread gives too), so only text is pickled
    assert unpicklable.content.startswith("<function lambda_tool.<locals>.<lambda> at ")


def test_which_tools_run_in_workers_and_runners_share_them():
    tools = load_tools([hostile.pid_tool, "calculator", remaining_async])
    runner, twin = ToolRunner(tools), ToolRunner(dict(tools))
    assert runner.pool("pid_tool") is twin.pool("pid_tool")  # one set of workers per tool function
    assert runner.pool("calculator") is None and runner.pool("remaining_async") is None
    threaded = ToolRunner(tools, isolation="thread")
    assert threaded.pool("pid_tool") is None
    assert threaded.run([ToolCall("pid_tool", {"x": 0})])[0].content == str(os.getpid())
    with pytest.raises(ValueError, match="data.multiturn.tool_isolation must be one of process, thread"):
        ToolRunner(tools, isolation="fork")
