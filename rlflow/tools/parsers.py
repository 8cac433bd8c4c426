"""Tool-call parsers: the tool calls a model wrote in a completion, found in its text.

A parser is registered in the ``rlflow.tool_parsers`` entry-point group and subclasses :class:`ToolParser`:
``parse(text)`` returns the assistant text without the calls and the :class:`~rlflow.tools.base.ToolCall` list.
Built in: ``hermes``, the ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` format of Qwen2.5/Qwen3,
Hermes and the chat templates that copy them. A block that is not valid JSON, lacks ``name`` or has arguments
that are not an object becomes a call with ``error`` set (the model gets a tool message saying what was wrong), so
a malformed call is counted as a failed call rather than silently ignored. Simplification: an unclosed
``<tool_call>`` at the very end of a completion is a malformed call too (the completion ran out of tokens or
stopped inside it).
"""

from __future__ import annotations

import json
import re
from typing import Any

from rlflow.tools.base import ToolCall

GROUP = "rlflow.tool_parsers"


class ToolParser:
    """Base class of tool-call parsers: override :meth:`parse`."""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(text without the calls, calls in order)``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement parse()")


class HermesToolParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` blocks (Qwen2.5/Qwen3/Hermes chat templates)."""

    def __init__(self, start: str = "<tool_call>", end: str = "</tool_call>") -> None:
        """``start``/``end``: the tags around each call."""
        self.start, self.end = start, end
        self.pattern = re.compile(re.escape(start) + r"(.*?)" + re.escape(end), re.DOTALL)

    @staticmethod
    def to_call(body: str) -> ToolCall:
        try:
            obj: Any = json.loads(body)
        except json.JSONDecodeError as exc:
            return ToolCall("", None, f"not valid JSON ({exc.msg} at character {exc.pos}): {body.strip()[:200]!r}")
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return ToolCall("", None, f'a call must be an object with a "name" string: {body.strip()[:200]!r}')
        args = obj.get("arguments", {})
        if isinstance(args, str):  # some models write the arguments as a JSON string, as the OpenAI API does
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            return ToolCall(obj["name"], None, f'"arguments" must be a JSON object, got {type(args).__name__}')
        return ToolCall(obj["name"], args)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        calls = [self.to_call(m.group(1)) for m in self.pattern.finditer(text)]
        rest = self.pattern.sub("", text)
        if self.start in rest:  # an unclosed block
            head, _, body = rest.partition(self.start)
            calls.append(ToolCall("", None, f"unclosed {self.start} (no {self.end}): {body.strip()[:200]!r}"))
            rest = head
        return rest.strip(), calls
