"""Tools: plain Python functions the policy may call during a rollout, their JSON schemas, and running the calls.

A tool is what ``trl.GRPOTrainer(tools=[...])`` takes: a type-hinted function (sync or ``async def``) with a
Google-style docstring. Its JSON schema comes from ``transformers.utils.get_json_schema`` (the same schema
``apply_chat_template(tools=[fn])`` renders), so any tool written for TRL works unchanged. Tools are named in the
config by import path (``data.multiturn.tools: [my_pkg.tools:search]``) or by the short name a package registers in the
``rlflow.tools`` entry-point group (``calculator`` and ``python`` are built in).

:class:`ToolRunner` runs the calls of one model turn concurrently, each with a timeout, on its own event loop
(the judger runner's approach: ``async`` tools as tasks, plain ones each in a daemon thread that can be
abandoned). A call to an unknown tool, with arguments that do not fit the signature or that failed to parse, a
tool that raises and a tool that times out all become a :class:`ToolResult` with ``ok=False`` whose ``content``
says what went wrong, for the model to read; the rollout goes on. Simplifications: a timed-out thread is
abandoned, not killed (Python cannot kill threads; the ``python`` tool runs its code in a killable subprocess);
a tool's return value is turned into text with ``str`` (``json.dumps`` for dicts and lists).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import json
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlflow import registry
from rlflow.config_error import ConfigError
from rlflow.judgers.runner import _in_daemon_thread, _serve, is_async

GROUP = "rlflow.tools"


@dataclass
class ToolCall:
    """One call parsed from a completion; ``error`` is set when the call could not be parsed (``arguments`` is then
    None), so the model is told why rather than the call being dropped."""

    name: str
    arguments: dict[str, Any] | None
    error: str | None = None


@dataclass
class ToolResult:
    """What a call returned, as the text of the tool message; ``ok`` is False for every kind of failure, and
    ``failure`` names it (``unknown_tool``, ``bad_arguments``, ``raised``, ``timeout``)."""

    name: str
    content: str
    ok: bool = True
    failure: str | None = None


@dataclass
class Tool:
    """A callable with its name and JSON schema (``{"type": "function", "function": {...}}``)."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any] = field(default_factory=dict)


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The JSON schema of ``fn`` from its signature and Google-style docstring (transformers' ``get_json_schema``);
    a tool without type hints or a docstring is an error naming it."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as exc:  # transformers raises DocstringParsingException / TypeHintParsingException
        name = getattr(fn, "__name__", repr(fn))
        raise ConfigError(
            f"data.multiturn.tools: cannot build the JSON schema of tool {name!r}: {exc} (a tool needs type hints "
            "on every argument and a Google-style docstring with an Args: section)"
        ) from exc


def load_tool(spec: Any) -> Tool:
    """A :class:`Tool` from a short name of the ``rlflow.tools`` group, an import path or a callable."""
    fn = registry.build(GROUP, spec) if isinstance(spec, str) else spec
    if not callable(fn):
        raise ConfigError(f"data.multiturn.tools: {spec!r} is not callable (a tool is a function)")
    schema = tool_schema(fn)
    return Tool(schema["function"]["name"], fn, schema)


def load_tools(specs: Sequence[Any] | None) -> dict[str, Tool]:
    """Every configured tool by name; two tools of one name are an error."""
    tools: dict[str, Tool] = {}
    for spec in specs or []:
        tool = load_tool(spec)
        if tool.name in tools:
            raise ConfigError(f"data.multiturn.tools: two tools are named {tool.name!r}; tool names must be unique")
        tools[tool.name] = tool
    return tools


def result_text(value: Any) -> str:
    """The text of a tool's return value in the tool message."""
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        try:
            return json.dumps(value)
        except TypeError:
            pass
    return str(value)


class ToolRunner:
    """Runs tool calls concurrently, each with ``timeout`` seconds, and turns every failure into a tool message.

    Args:
        tools: The tools by name (:func:`load_tools`).
        timeout: Seconds one call may take; None waits forever.
    """

    def __init__(self, tools: dict[str, Tool], timeout: float | None = 30.0) -> None:
        if timeout is not None and timeout <= 0:
            raise ValueError(f"data.multiturn.tool_timeout must be positive seconds (or null), got {timeout}")
        self.tools = tools
        self.timeout = timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # the loop and its thread do not pickle; they restart lazily
        return {**self.__dict__, "_loop": None, "_lock": None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                threading.Thread(target=_serve, args=(loop,), name="rlflow-tool-loop", daemon=True).start()
                weakref.finalize(self, loop.call_soon_threadsafe, loop.stop)
                self._loop = loop
            return self._loop

    def check(self, call: ToolCall) -> ToolResult | None:
        """A failed result if ``call`` cannot be made (parse error, unknown tool, arguments not fitting)."""
        if call.error is not None:
            return ToolResult(
                call.name or "?", f"Error: the tool call could not be parsed: {call.error}", False, "bad_arguments"
            )
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolResult(
                call.name,
                f"Error: unknown tool {call.name!r}; available tools: {', '.join(sorted(self.tools)) or '(none)'}",
                False,
                "unknown_tool",
            )
        try:
            inspect.signature(tool.fn).bind(**(call.arguments or {}))
        except TypeError as exc:
            return ToolResult(call.name, f"Error: bad arguments for tool {call.name!r}: {exc}", False, "bad_arguments")
        return None

    async def _call(self, call: ToolCall) -> ToolResult:
        failed = self.check(call)
        if failed is not None:
            return failed
        fn = self.tools[call.name].fn

        async def invoke() -> Any:
            if is_async(fn):
                return await fn(**call.arguments)
            out = await _in_daemon_thread(fn, dict(call.arguments or {}), call.name)
            return await out if inspect.isawaitable(out) else out

        try:
            value = await asyncio.wait_for(invoke(), self.timeout)
        except asyncio.TimeoutError:
            return ToolResult(
                call.name, f"Error: tool {call.name!r} timed out after {self.timeout} s", False, "timeout"
            )
        except Exception as exc:  # noqa: BLE001 - a failing tool is a message to the model, not a crash
            return ToolResult(
                call.name, f"Error: tool {call.name!r} raised {type(exc).__name__}: {exc}", False, "raised"
            )
        return ToolResult(call.name, result_text(value))

    async def _call_all(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        return list(await asyncio.gather(*(self._call(c) for c in calls)))

    def submit(self, calls: Sequence[ToolCall]) -> concurrent.futures.Future:
        """Start ``calls`` on the runner's loop; the future's result is :meth:`run`'s."""
        return asyncio.run_coroutine_threadsafe(self._call_all(calls), self.loop())

    def run(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """Run ``calls`` concurrently; one result per call, in order."""
        if not calls:
            return []
        return asyncio.run_coroutine_threadsafe(self._call_all(calls), self.loop()).result()
