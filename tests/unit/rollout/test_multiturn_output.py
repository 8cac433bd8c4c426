"""Multi-turn rollouts cut what user code hands back before it is rendered, tokenized and kept: a tool result
(``data.multiturn.tools`` and an ``environment_factory``'s methods) and the text of an environment's observation,
each to ``max_tool_output`` characters, saying how much was cut."""

from __future__ import annotations

from rlflow.environments import Environment, EnvStep
from rlflow.rollout.multiturn import MultiTurn, multiturn_metrics
from rlflow.tools.base import load_tools
from tests.helpers.multiturn_helpers import ScriptedBackend, qwen3_char_tokenizer
from tests.unit.rollout.test_multiturn import END, params, record
from tests.unit.tools import result_tools

N = 2_000_000
NOTICE = f"\n... [truncated {N - 50} characters]"


def call(name: str, arguments: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>' + END


def test_a_huge_tool_result_is_cut_before_it_is_inserted_and_kept():
    tok = qwen3_char_tokenizer()
    tools = load_tools([result_tools.huge, result_tools.circular])
    mt = MultiTurn(tok, tools, max_turns=2, max_tool_output=50, tool_isolation="thread")
    backend = ScriptedBackend(tok, [[call("huge", f'{{"n": {N}}}'), call("circular", '{"x": 1}')], ["ok" + END]])
    (cut, failed), = mt.generate(backend, [record(tok, "Go.", tools)], params(tok, 2000), n=2)
    assert cut.messages[1]["content"] == "x" * 50 + NOTICE
    inserted = tok.decode([t for t, sampled in zip(cut.token_ids, cut.mask) if not sampled])
    assert "x" * 50 + NOTICE in inserted and len(inserted) < 200
    assert cut.info["turns"] == 2 and cut.finish_reason == "stop"
    assert failed.messages[1]["content"].startswith("Error: tool 'circular' returned a list that cannot be turned")
    assert multiturn_metrics([cut, failed])["tools/failures/bad_result"] == 1.0


class Flood(Environment):
    """Answers the first turn with a huge observation."""

    def step(self, text):
        return EnvStep([{"role": "user", "content": "y" * N}])


def test_an_environment_observation_is_cut_like_a_tool_result():
    tok = qwen3_char_tokenizer()
    mt = MultiTurn(tok, {}, environment=Flood(), max_turns=2, max_tool_output=50)
    parts = {"role": "user", "content": [{"type": "text", "text": "z" * N}, {"type": "image"}]}  # content parts too
    assert mt.cut_message(parts) == {"role": "user", "content": [{"type": "text", "text": "z" * 50 + NOTICE},
                                                                 {"type": "image"}]}
    backend = ScriptedBackend(tok, [["guess" + END], ["done" + END]])
    (c,), = mt.generate(backend, [record(tok, "Go.")], params(tok, 2000), n=1)
    assert c.messages[1]["content"] == "y" * 50 + NOTICE
    assert "y" * 50 + NOTICE in tok.decode([t for t, sampled in zip(c.token_ids, c.mask) if not sampled])


class Dumper:
    """An environment_factory class whose one tool returns megabytes."""

    def reset(self, **row) -> None:
        return None

    def dump(self, n: int) -> str:
        """Returns ``n`` characters.

        Args:
            n: How many.
        """
        return "w" * n


def test_an_environment_factory_tool_result_is_cut_with_the_shared_bound():
    tok = qwen3_char_tokenizer()
    mt = MultiTurn(tok, {}, environment_factory=Dumper, max_turns=2, max_tool_output=50)
    backend = ScriptedBackend(tok, [[call("dump", f'{{"n": {N}}}')], ["ok" + END]])
    (c,), = mt.generate(backend, [record(tok, "Go.", None)], params(tok, 2000), n=1)
    assert c.messages[1]["content"] == "w" * 50 + NOTICE
