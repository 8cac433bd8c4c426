"""Tools that end their call the hard way: ``SystemExit`` and ``KeyboardInterrupt`` from a tool are failed calls, never
a hang of the runner or of a multi-turn rollout; :func:`time_left` gives a tool its call's deadline."""

from __future__ import annotations

import sys
import threading

from rlflow.rollout.multiturn import MultiTurn, multiturn_metrics
from rlflow.tools.base import ToolCall, ToolRunner, load_tools, time_left
from tests.helpers.multiturn_helpers import ScriptedBackend, add, qwen3_char_tokenizer
from tests.unit.rollout.test_multiturn import END, params, record


def in_time(fn, seconds):
    """``fn()``'s value, or "hung" when it has not returned after ``seconds`` (its daemon thread is left behind)."""
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    return out[0] if out else "hung"


def exits(code: int) -> int:
    """Calls sys.exit, as a script or argparse does.

    Args:
        code: The exit status.
    """
    sys.exit(code)


def interrupted(x: int) -> int:
    """Raises KeyboardInterrupt.

    Args:
        x: Ignored.
    """
    raise KeyboardInterrupt


async def exits_async(code: int) -> int:
    """An async tool calling sys.exit.

    Args:
        code: The exit status.
    """
    sys.exit(code)


def remaining(x: int) -> str:
    """Reports the seconds its call has left.

    Args:
        x: Ignored.
    """
    return repr(time_left())


async def remaining_async(x: int) -> str:
    """Reports the seconds its call has left.

    Args:
        x: Ignored.
    """
    return repr(time_left())


def test_systemexit_and_keyboardinterrupt_from_a_tool_are_failed_calls_not_a_hang():
    runner = ToolRunner(load_tools([exits, interrupted, exits_async, add]), timeout=5)
    calls = [ToolCall("exits", {"code": 3}), ToolCall("interrupted", {"x": 1}), ToolCall("exits_async", {"code": 4}),
             ToolCall("add", {"a": 1, "b": 2})]
    results = in_time(lambda: runner.run(calls), 20)
    assert results != "hung", "ToolRunner.run never returned after a tool raised SystemExit"
    assert [(r.ok, r.failure) for r in results] == [(False, "raised")] * 3 + [(True, None)]
    assert results[0].content == "Error: tool 'exits' raised SystemExit: 3"
    assert results[1].content == "Error: tool 'interrupted' raised KeyboardInterrupt: "
    assert results[2].content == "Error: tool 'exits_async' raised SystemExit: 4" and results[3].content == "3"
    again = in_time(lambda: runner.run([ToolCall("add", {"a": 2, "b": 2})]), 20)  # the runner still serves
    assert again != "hung" and again[0].content == "4"


def test_a_rollout_whose_tool_exits_goes_on_and_counts_the_failure():
    tok = qwen3_char_tokenizer()
    tools = load_tools([exits, add])
    mt = MultiTurn(tok, tools, max_turns=3, tool_timeout=5)
    call = '<tool_call>{"name": "exits", "arguments": {"code": 2}}</tool_call>'
    backend = ScriptedBackend(tok, [[call + END, call + END], ["ok" + END, "ok" + END]])
    out = in_time(lambda: mt.generate(backend, [record(tok, "Go.", tools)], params(tok), n=2), 60)
    assert out != "hung", "a multi-turn rollout hung on a tool that raised SystemExit"
    (group,) = out
    assert all(c.messages[1]["content"] == "Error: tool 'exits' raised SystemExit: 2" for c in group)
    assert all(c.messages[-1]["content"] == "ok" and c.info["turns"] == 2 for c in group)
    metrics = multiturn_metrics(group)
    assert metrics["tools/failure_frequency"] == 1.0 and metrics["tools/failures/raised"] == 2.0


def test_time_left_counts_down_to_the_tool_timeout():
    runner = ToolRunner(load_tools([remaining, remaining_async]), timeout=3)
    left = [float(r.content) for r in runner.run([ToolCall("remaining", {"x": 0}),
                                                  ToolCall("remaining_async", {"x": 0})])]
    assert all(0 < t <= 3 for t in left), left
    unlimited = ToolRunner(load_tools([remaining]), timeout=None)
    assert unlimited.run([ToolCall("remaining", {"x": 0})])[0].content == "None"
    assert time_left() is None  # outside a call
