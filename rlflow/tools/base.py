"""Tools: plain Python functions the policy may call during a rollout, their JSON schemas, and running the calls.

A tool is what ``trl.GRPOTrainer(tools=[...])`` takes: a type-hinted function (sync or ``async def``) with a
Google-style docstring. Its JSON schema comes from ``transformers.utils.get_json_schema`` (the same schema
``apply_chat_template(tools=[fn])`` renders), so any tool written for TRL works unchanged. Tools are named in the
config by import path (``data.multiturn.tools: [my_pkg.tools:search]``), by the short name a package registers in the
``rlflow.tools`` entry-point group (``calculator`` and ``python`` are built in), or, for a tool class with settings,
as ``{class_path: <name or path>, init_args: {...}}``: its instance is the tool, ``__call__`` gives the schema and
its ``name`` attribute the tool's name.

:class:`ToolRunner` runs the calls of one model turn concurrently, each with a timeout, on its own event loop
(the judger runner's approach). With ``isolation="process"`` (the default, ``data.multiturn.tool_isolation``) a
user's plain tool runs in a worker process (:class:`rlflow.isolation.Isolated`, one per concurrent call, kept for
later calls): at the timeout the worker is killed with every process it started, and the next call gets a fresh
one; a worker that dies fails its call (``crashed``). ``async`` tools run as tasks; rlflow's own tools, tools a new
process cannot load (a closure, a lambda: with a warning) and, with ``isolation="thread"``, every plain tool run in
a daemon thread that is abandoned at the timeout. A call to an
unknown tool, with arguments that do not fit the signature or that failed to parse, a tool that raises (any
exception: ``SystemExit`` and ``KeyboardInterrupt`` raised inside a tool too), crashes or times out all become a
:class:`ToolResult` with ``ok=False`` whose ``content`` says what went wrong, for the model to read; the rollout
goes on. Inside a call, :func:`time_left` says how long the call has left (in a worker process too): a tool that
starts work it can stop (the ``python`` tool's sandboxed process) stops it at that deadline, so nothing it started
outlives the call.

A tool's return value becomes the text of its message (:func:`result_text`: ``str``, ``json.dumps`` for dicts and
lists), cut to ``max_output`` characters (``data.multiturn.max_tool_output``; the rest cut, saying how much, as
the ``python`` tool cuts its output) where the call ran, within its time: in the worker process (only the cut
text crosses the pipe), in the tool's thread, or, for an ``async`` tool's value that is not a string, in a daemon
thread. A value that cannot be turned into text (a list that contains itself, a ``__str__`` that raises) is a
failed call (``bad_result``) whose message names the value's type. Simplifications: a thread that times out is
abandoned, not killed (Python cannot kill threads).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
import json
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlflow import registry
from rlflow.config_error import ConfigError
from rlflow.isolation import Isolated, Outcome, WorkerCrashed, WorkerError, _awaited, _cut, _type_name, portable
from rlflow.judgers.runner import ISOLATIONS, _Call, _in_daemon_thread, _serve, is_async, is_rlflows

GROUP = "rlflow.tools"
log = logging.getLogger(__name__)
#: When the tool call running in this thread or task must end (``time.monotonic()``); None: no limit.
_deadline: contextvars.ContextVar[float | None] = contextvars.ContextVar("rlflow_tool_deadline", default=None)


def time_left() -> float | None:
    """Seconds the tool call running in this thread or task has left before ``data.multiturn.tool_timeout`` ends
    it (at least 0); None outside a call or without a timeout. A tool that starts work it can stop (a process, a
    request) gives that work at most this long, so the work ends with the call instead of running on unwatched."""
    deadline = _deadline.get()
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _until(deadline: float | None, fn: Callable[..., Any], /, **arguments: Any) -> Any:
    """``fn(**arguments)`` with :func:`time_left` counting down to ``deadline``."""
    _deadline.set(deadline)
    return fn(**arguments)


def _tool_in_worker(fn: Callable[..., Any], deadline: float | None, limit: int | None = None, /,
                    **arguments: Any) -> tuple[str, str | None]:
    """:func:`_until` with the tool first, its value turned into text cut to ``limit`` characters there
    (:func:`converted`): the callable a tool's worker process keeps (``time.monotonic`` is the same clock in every
    process). Only ``(text, error)``, two strings (or None), travel back to the trainer (:func:`_from_worker`)."""
    out = _until(deadline, fn, **arguments)
    if inspect.isawaitable(out):  # a plain function handing back a coroutine
        out = asyncio.run(_awaited(out))
    text = converted(out, limit)
    return text.text, text.error


def _tool_in_thread(fn: Callable[..., Any], deadline: float | None, limit: int | None, /, **arguments: Any) -> Any:
    """:func:`_until`, in the tool's thread: its value as text cut to ``limit`` (:func:`converted`), or the
    awaitable it handed back (awaited on the runner's loop)."""
    out = _until(deadline, fn, **arguments)
    return out if inspect.isawaitable(out) else converted(out, limit)


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
    ``failure`` names it (``unknown_tool``, ``bad_arguments``, ``raised``, ``timeout``, ``crashed``: its worker
    process died or could not load the tool; ``bad_result``: its value could not be turned into text)."""

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
    a tool without type hints or a docstring is an error naming it. A tool object (not a function) is described
    by its ``__call__`` and named by its ``name`` attribute (else its class's name)."""
    from transformers.utils import get_json_schema

    is_object = not (inspect.isfunction(fn) or inspect.ismethod(fn) or inspect.isbuiltin(fn))
    try:
        schema = get_json_schema(fn.__call__ if is_object else fn)
    except Exception as exc:  # transformers raises DocstringParsingException / TypeHintParsingException
        name = getattr(fn, "__name__", None) or getattr(fn, "name", None) or type(fn).__name__
        raise ConfigError(
            f"data.multiturn.tools: cannot build the JSON schema of tool {name!r}: {exc} (a tool needs type hints "
            "on every argument and a Google-style docstring with an Args: section)"
        ) from exc
    if is_object:
        schema["function"]["name"] = str(getattr(fn, "name", None) or type(fn).__name__)
    return schema


def load_tool(spec: Any) -> Tool:
    """A :class:`Tool` from a short name of the ``rlflow.tools`` group, an import path, a ``class_path``/``init_args``
    mapping or a callable."""
    fn = registry.build(GROUP, spec) if isinstance(spec, (str, dict)) else spec
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


#: Each tool function's worker processes, shared by the runners that have it (a multi-turn rollout's runner and
#: the per-trajectory runners beside it); they end once no runner holds them.
_TOOL_POOLS: weakref.WeakValueDictionary[int, Isolated] = weakref.WeakValueDictionary()
_TOOL_POOLS_LOCK = threading.Lock()
_IN_THREAD: set[str] = set()  # tools warned about running in a thread


def _tool_pool(fn: Callable[..., Any], name: str) -> Isolated | None:
    """The worker processes of tool function ``fn`` (a new :class:`~rlflow.isolation.Isolated` unless a runner
    holds one); None for a tool a new process cannot load (a closure, a lambda, a function of ``__main__``), which
    runs in a thread (with a warning, once per tool name)."""
    with _TOOL_POOLS_LOCK:
        pool = _TOOL_POOLS.get(id(fn))
        if pool is not None and pool.source is fn:
            return pool
        payload, why = portable(functools.partial(_tool_in_worker, fn))
        if payload is None:
            if name not in _IN_THREAD:
                _IN_THREAD.add(name)
                log.warning("tool %r runs in a thread of the trainer, where a timeout abandons it instead of stopping "
                            "it: a worker process cannot load it (%s); name it by import path", name, why)
            return None
        pool = _TOOL_POOLS[id(fn)] = Isolated(payload, f"tool {name!r}", source=fn)
        return pool


#: Characters of a tool result's text kept by default (``data.multiturn.max_tool_output``).
MAX_TOOL_OUTPUT = 4096


@dataclass(frozen=True)
class _Text:
    """A tool's value as the text of its message (cut), or ``error``: why it could not be turned into text."""

    text: str
    error: str | None = None


def result_text(value: Any) -> str:
    """The text of a tool's return value in the tool message (a plain ``str``): the string itself, ``json.dumps``
    of a dict or list (``str`` of one that holds what JSON cannot), else ``str``. Raises what the conversion raises
    (a list that contains itself, a ``__str__`` that raises)."""
    if isinstance(value, str):
        return str.__str__(value)  # a plain copy of a str subclass, whatever its methods do
    if isinstance(value, (dict, list)):
        try:
            return json.dumps(value)
        except TypeError:
            pass
    text = str(value)
    return text if type(text) is str else str.__str__(text)


def _safe_str(value: Any) -> str:
    """``str(value)`` or, where that fails, a placeholder: for messages about hostile values."""
    try:
        return result_text(value)
    except BaseException:  # noqa: BLE001 - its __str__ raised, whatever it raised
        return "<unprintable>"


def _from_worker(value: Any, limit: int | None) -> _Text:
    """What :func:`_tool_in_worker` sent back, ``(text, error)``, as a :class:`_Text` (anything else, converted
    here)."""
    if isinstance(value, (tuple, list)) and len(value) == 2 and type(value[0]) is str and (
            value[1] is None or type(value[1]) is str):
        return _bounded(_Text(value[0], value[1]), limit)
    return converted(value, limit)


def _bounded(text: _Text, limit: int | None) -> _Text:
    """``text`` cut again where it is longer than :func:`converted` leaves a text (64: room for the cut notice):
    what a worker process sent back is the tool's own code's doing."""
    if limit is None or (len(text.text) <= limit + 64 and (text.error is None or len(text.error) <= limit + 64)):
        return text
    return _Text(converted(text.text, limit).text, None if text.error is None else converted(text.error, limit).text)


def truncate(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, with a line saying how many were cut."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... [truncated {len(text) - limit} characters]"


def converted(value: Any, limit: int | None) -> _Text:
    """``value`` as the text of a tool message, cut to ``limit`` characters (the rest cut, saying how much:
    :func:`truncate`; None: not cut), or why it cannot be turned into text. Never raises."""
    try:
        text = result_text(value)
        return _Text(text if limit is None else truncate(text, limit))
    except BaseException as exc:  # noqa: BLE001 - SystemExit from a __str__ too: the call's failure, not the run's
        return _Text("", f"a {_type_name(value)} that cannot be turned into text "
                         f"({_type_name(exc)}: {_cut(_safe_str(exc), 300)})")


class ToolRunner:
    """Runs tool calls concurrently, each with ``timeout`` seconds, and turns every failure into a tool message.

    Args:
        tools: The tools by name (:func:`load_tools`).
        timeout: Seconds one call may take; None waits forever.
        isolation: ``process``: a user's plain tool runs in worker processes, killed at the timeout; ``thread``:
            every tool runs in the trainer (a hung one is abandoned).
        max_output: Characters of a result's text kept; the rest is cut, saying how much.
    """

    def __init__(self, tools: dict[str, Tool], timeout: float | None = 30.0, isolation: str = "process",
                 max_output: int = MAX_TOOL_OUTPUT) -> None:
        if timeout is not None and timeout <= 0:
            raise ValueError(f"data.multiturn.tool_timeout must be positive seconds (or null), got {timeout}")
        if isolation not in ISOLATIONS:
            raise ValueError(f"data.multiturn.tool_isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
        if isinstance(max_output, bool) or not isinstance(max_output, int) or max_output < 1:
            raise ValueError(f"data.multiturn.max_tool_output must be a whole number of characters >= 1, got "
                             f"{max_output!r}")
        self.tools = tools
        self.timeout = timeout
        self.isolation = isolation
        self.max_output = max_output
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._pools: dict[str, Isolated | None] = {}  # each tool's worker processes (None: in the trainer)

    def __getstate__(self) -> dict[str, Any]:  # the loop, its thread and processes do not pickle; they restart lazily
        return {**self.__dict__, "_loop": None, "_lock": None, "_pools": {}}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def pool(self, name: str) -> Isolated | None:
        """The worker processes of tool ``name`` (made on first use, shared with every runner that has the same
        tool function): a user's plain tool with ``isolation="process"``; None where it runs in the trainer
        (``async``, rlflow's own, or ``thread``)."""
        with self._lock:
            if name not in self._pools:
                fn = self.tools[name].fn
                pooled = self.isolation == "process" and not is_async(fn) and not is_rlflows(fn)
                self._pools[name] = _tool_pool(fn, name) if pooled else None
            return self._pools[name]

    def close(self) -> None:
        """Kill the tools' idle worker processes (later calls start new ones)."""
        for pool in list(self._pools.values()):
            if pool is not None:
                pool.close()

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

    def _in_worker(self, pool: Isolated, arguments: dict[str, Any]) -> tuple[Outcome, bool]:
        """One call in ``pool``'s worker process (loaded before the call's time starts): how it ended, and whether
        it ran out of time (killed, or it stopped itself at its deadline)."""
        try:
            worker = pool.acquire()
        except WorkerError as exc:
            return Outcome(error=exc), False
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        outcome = pool.run(worker, (deadline, self.max_output), arguments, self.timeout)
        if outcome.error is None:
            outcome.value = _from_worker(outcome.value, self.max_output)
        return outcome, outcome.killed or (deadline is not None and time.monotonic() >= deadline)

    async def _call(self, call: ToolCall) -> ToolResult:
        failed = self.check(call)
        if failed is not None:
            return failed
        pool = self.pool(call.name)
        if pool is not None:
            outcome, timed_out = await _in_daemon_thread(
                self._in_worker, {"pool": pool, "arguments": dict(call.arguments or {})}, call.name, _Call())
            return self._result(call.name, outcome.value, outcome.error, timed_out)
        fn = self.tools[call.name].fn
        deadline = None if self.timeout is None else time.monotonic() + self.timeout

        async def invoke() -> tuple[Any, BaseException | None]:
            # Everything the tool raises is caught here, inside the task that wait_for runs: a SystemExit or
            # KeyboardInterrupt leaving a task stops the event loop itself, and every later call would wait forever.
            try:
                if is_async(fn):
                    _deadline.set(deadline)  # this task's own context
                    out = fn(**call.arguments)
                else:
                    out = await _in_daemon_thread(functools.partial(_tool_in_thread, fn, deadline, self.max_output),
                                                  dict(call.arguments or {}), call.name, _Call())
                if inspect.isawaitable(out):
                    out = await out
                if isinstance(out, _Text):
                    return out, None
                if type(out) is str:  # cut here; anything else is converted in a thread, within the timeout
                    return converted(out, self.max_output), None
                return await _in_daemon_thread(converted, {"value": out, "limit": self.max_output}, call.name,
                                               _Call()), None
            except asyncio.CancelledError:  # the call timed out
                raise
            except BaseException as exc:  # noqa: BLE001 - a failing tool is a message to the model, not a crash
                return None, exc

        value: Any = None
        try:
            value, exc = await asyncio.wait_for(invoke(), self.timeout)
            timed_out = deadline is not None and time.monotonic() >= deadline  # it stopped itself at the deadline
        except asyncio.TimeoutError:
            exc, timed_out = None, True
        return self._result(call.name, value, exc, timed_out)

    def _result(self, name: str, value: Any, exc: BaseException | None, timed_out: bool) -> ToolResult:
        """The tool message of a call that returned ``value`` (its :class:`_Text`, or the value itself), raised
        ``exc`` or ran out of time; never longer than ``max_output`` characters and the cut notice."""
        if timed_out:
            return ToolResult(name, f"Error: tool {name!r} timed out after {self.timeout} s", False, "timeout")
        if isinstance(exc, WorkerCrashed):
            return ToolResult(name, self._cut(f"Error: tool {name!r} crashed: {_safe_str(exc)}"), False, "crashed")
        if exc is not None:
            return ToolResult(name, self._cut(f"Error: tool {name!r} raised {_type_name(exc)}: {_safe_str(exc)}"),
                              False, "raised")
        text = _bounded(value, self.max_output) if isinstance(value, _Text) else converted(value, self.max_output)
        if text.error is not None:
            return ToolResult(name, f"Error: tool {name!r} returned {text.error}", False, "bad_result")
        return ToolResult(name, text.text)

    def _cut(self, text: str) -> str:
        return converted(text, self.max_output).text

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
