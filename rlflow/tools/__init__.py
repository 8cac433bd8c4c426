"""Tools the policy can call in multi-turn rollouts (the ``rlflow.tools`` and ``rlflow.tool_parsers`` groups)."""

from rlflow.tools.base import Tool, ToolCall, ToolResult, ToolRunner, load_tools, tool_schema
from rlflow.tools.parsers import HermesToolParser, ToolParser

__all__ = ["HermesToolParser", "Tool", "ToolCall", "ToolParser", "ToolResult", "ToolRunner", "load_tools",
           "tool_schema"]
