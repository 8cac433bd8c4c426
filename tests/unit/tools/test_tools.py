"""Tools: schemas from TRL-style functions, the Hermes parser, the runner's failure handling, the built-ins."""

from __future__ import annotations

import time

import pytest

from rlflow.config_error import ConfigError
from rlflow.tools.base import ToolCall, ToolRunner, load_tools, tool_schema
from rlflow.tools.calculator import calculator
from rlflow.tools.parsers import HermesToolParser
from tests.helpers.multiturn_helpers import add, boom, hang, multiply


def get_current_temperature(location: str, unit: str = "celsius") -> float:
    """Get the current temperature at a location.

    Args:
        location: The location, as "City, Country".
        unit: The unit to return the temperature in. (choices: ["celsius", "fahrenheit"])
    """
    return 22.0


def test_schema_of_a_trl_style_tool():
    schema = tool_schema(get_current_temperature)
    fn = schema["function"]
    assert schema["type"] == "function" and fn["name"] == "get_current_temperature"
    assert fn["description"] == "Get the current temperature at a location."
    props = fn["parameters"]["properties"]
    assert props["location"] == {"type": "string", "description": 'The location, as "City, Country".'}
    assert props["unit"]["enum"] == ["celsius", "fahrenheit"]
    assert fn["parameters"]["required"] == ["location"]  # unit has a default


def test_tools_from_config_paths_and_entry_points():
    tools = load_tools(["tests.helpers.multiturn_helpers:add", "calculator", multiply])
    assert sorted(tools) == ["add", "calculator", "multiply"]
    assert tools["calculator"].schema["function"]["parameters"]["required"] == ["expression"]


def test_tool_without_docstring_or_duplicate_is_a_config_error():
    def nodoc(x: int) -> int:
        return x

    with pytest.raises(ConfigError, match="data.multiturn.tools.*nodoc"):
        load_tools([nodoc])
    with pytest.raises(ConfigError, match="two tools are named 'add'"):
        load_tools([add, "tests.helpers.multiturn_helpers:add"])


def test_tools_reach_the_chat_template():
    from tests.helpers.multiturn_helpers import qwen3_char_tokenizer

    tok = qwen3_char_tokenizer()
    schema = tool_schema(add)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[schema], tokenize=False)
    assert '"name": "add"' in text and "<tools>" in text


# ------------------------------------------------------------------------------------------------ parser
def test_parser_well_formed_single_and_multiple_calls():
    p = HermesToolParser()
    text, calls = p.parse('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')
    assert text == "Let me add." and calls == [ToolCall("add", {"a": 1, "b": 2})]
    text, calls = p.parse('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
                          '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>')
    assert text == "" and [c.name for c in calls] == ["add", "calculator"]
    assert calls[1].arguments == {"expression": "2*3"}  # arguments given as a JSON string are decoded
    assert p.parse("no calls here") == ("no calls here", [])


@pytest.mark.parametrize("body, message", [
    ('{"name": "add", "arguments": {"a": 1,}}', "not valid JSON"),
    ('{"arguments": {"a": 1}}', '"name" string'),
    ('["add"]', '"name" string'),
    ('{"name": "add", "arguments": [1, 2]}', "must be a JSON object"),
])
def test_parser_malformed_calls_become_failed_calls(body, message):
    text, calls = HermesToolParser().parse(f"ok <tool_call>{body}</tool_call>")
    assert text == "ok" and len(calls) == 1 and calls[0].arguments is None and message in calls[0].error


def test_parser_unclosed_call():
    text, calls = HermesToolParser().parse('before <tool_call>{"name": "add"')
    assert text == "before" and calls[0].error.startswith("unclosed <tool_call>")


# ------------------------------------------------------------------------------------------------ runner
def test_runner_results_and_every_failure_kind():
    runner = ToolRunner(load_tools([add, multiply, boom, hang]), timeout=0.5)
    calls = [
        ToolCall("add", {"a": 2, "b": 3}),
        ToolCall("multiply", {"a": 4, "b": 5}),
        ToolCall("boom", {"x": 1}),
        ToolCall("hang", {"x": 1}),
        ToolCall("add", {"a": 1}),  # missing argument
        ToolCall("add", {"a": 1, "b": 2, "c": 3}),  # unexpected argument
        ToolCall("nope", {}),
        ToolCall("", None, "not valid JSON"),
    ]
    t0 = time.perf_counter()
    results = runner.run(calls)
    assert time.perf_counter() - t0 < 5  # the hung tool is abandoned at its timeout
    assert [(r.content, r.ok) for r in results[:2]] == [("5", True), ("20", True)]
    assert [r.failure for r in results[2:]] == ["raised", "timeout", "bad_arguments", "bad_arguments",
                                                "unknown_tool", "bad_arguments"]
    assert "RuntimeError: boom 1" in results[2].content and "timed out after 0.5 s" in results[3].content
    assert "missing a required argument: 'b'" in results[4].content
    assert "available tools: add, boom, hang, multiply" in results[6].content


def test_runner_runs_calls_concurrently():
    def slow(x: int) -> int:
        """Sleeps 0.4 s.

        Args:
            x: Returned as is.
        """
        time.sleep(0.4)
        return x

    runner = ToolRunner(load_tools([slow]), timeout=10)
    t0 = time.perf_counter()
    results = runner.run([ToolCall("slow", {"x": i}) for i in range(6)])
    assert [r.content for r in results] == [str(i) for i in range(6)]
    assert time.perf_counter() - t0 < 6 * 0.4 * 0.75  # not one after another


# ------------------------------------------------------------------------------------------------ built-ins
def test_calculator():
    assert calculator("123 * 456") == "56088"
    assert calculator("(1 + 2) / 4") == "0.75"
    assert calculator("-2 ** 3") == str(-(2 ** 3))
    for bad in ("__import__('os')", "a + 1", "2 ** 1000", "[1, 2]"):
        with pytest.raises(ValueError):
            calculator(bad)
