# ruff: noqa: E501 - the chat template is kept as Qwen3 ships it
"""Helpers of the multi-turn tests: Qwen3's chat template on the character tokenizer, scripted and recording
backends, and small tools (one of each failure kind)."""

from __future__ import annotations

import asyncio
import time

import torch

from rlflow.rollout.base import Completion, RolloutBackend

# Qwen3's chat template (Qwen/Qwen3-8B tokenizer_config.json): tools in the system turn, <tool_call> blocks,
# tool results as <tool_response> user turns, and <think> blocks of turns before the last user query dropped
# (not append-only).
QWEN3_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for index in range(ns.last_query_index, -1, -1) %}
    {%- set message = messages[index] %}
    {%- if ns.multi_step_tool and message.role == "user" and not('<tool_response>' in message.content and '</tool_response>' in message.content) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


def qwen3_char_tokenizer():
    """The demo's character tokenizer (:mod:`rlflow.demo.tiny_model`) with Qwen3's chat template."""
    from rlflow.demo.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = QWEN3_TEMPLATE
    return tokenizer


class ScriptedBackend(RolloutBackend):
    """Answers each generate call with the next scripted texts (one per sequence; cycled per call), recording the
    prompt ids and the ids it returned; log-probs are ``-0.01 * (position + 1)`` so they can be told apart."""

    def __init__(self, tokenizer, turns: list[list[str]]):
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self.calls: list[tuple[list[list[int]], int, int]] = []  # (prompts, n, max_tokens)
        self.outputs: list[list[list[int]]] = []

    def generate(self, prompts, params, n=1, progress=None):
        texts = self.turns.pop(0)
        self.calls.append(([list(p) for p in prompts], n, params.max_tokens))
        groups, flat = [], []
        for i in range(len(prompts)):
            group = []
            for j in range(n):
                text = texts[(i * n + j) % len(texts)]
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                stop = bool(ids) and ids[-1] in params.stop_token_ids
                reason = "stop" if stop and len(ids) <= params.max_tokens else "length"
                ids = ids[: params.max_tokens]
                group.append(Completion(ids, [-0.01 * (t + 1) for t in range(len(ids))], reason))
                flat.append(ids)
            groups.append(group)
        self.outputs.append(flat)
        return groups


class RecordingBackend(RolloutBackend):
    """Wraps a real backend and records every call's prompts and the token ids it sampled."""

    def __init__(self, inner: RolloutBackend):
        self.inner = inner
        self.calls: list[tuple[list[list[int]], int]] = []
        self.outputs: list[list[Completion]] = []

    def generate(self, prompts, params, n=1, progress=None):
        groups = self.inner.generate(prompts, params, n=n)
        self.calls.append(([list(p) for p in prompts], n))
        self.outputs.append([c for g in groups for c in g])
        return groups


# ------------------------------------------------------------------------------------------------ tools
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


async def multiply(a: int, b: int) -> int:
    """Multiply two integers (an async tool).

    Args:
        a: The first integer.
        b: The second integer.
    """
    await asyncio.sleep(0)
    return a * b


def boom(x: int) -> int:
    """Always raises.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"boom {x}")


def hang(x: int) -> int:
    """Sleeps far past any timeout.

    Args:
        x: Anything.
    """
    time.sleep(60)
    return x


def tiny_model(vocab: int, seed: int = 0):
    """A 2-layer random Qwen3 over ``vocab`` tokens (sdpa attention), in eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model("qwen3", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                  max_position_embeddings=1024)
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).eval()
