"""TRL's ``environment_factory`` contract (:mod:`rlflow.environments.trl_factory`): tools from an environment class's
public methods, ``reset`` with the row, tool calls dispatched to each trajectory's own instance (a raising or hanging
method is a failed tool call), ``get_reward``, the pool of instances, the refusals, and ``environments`` reaching the
judgers that take it."""

from __future__ import annotations

import pytest

from rlflow.config_error import ConfigError
from rlflow.data.dataset import PromptRecord
from rlflow.environments.trl_factory import EnvironmentFactory
from rlflow.registry import PluginError
from rlflow.rollout.base import Completion, SamplingParams
from rlflow.rollout.multiturn import MultiTurn, multiturn_metrics
from tests.helpers.multiturn_helpers import ScriptedBackend, qwen3_char_tokenizer
from tests.helpers.trl_envs import CalculatorEnv, CounterEnv, NoToolsEnv, UntypedEnv

END = "<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    return qwen3_char_tokenizer()


def record(tok, question: str, schemas, **columns) -> PromptRecord:
    prompt = [{"role": "user", "content": question}]
    text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False, tools=schemas)
    return PromptRecord(prompt, dict(columns), "rows.jsonl:3", tok.encode(text, add_special_tokens=False), text)


def params(tok, max_tokens=400) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, stop_token_ids=[tok.eos_token_id])


def call(name: str, arguments: str = "{}") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>' + END


def test_public_methods_are_the_tools_with_transformers_schemas():
    from transformers.utils import get_json_schema

    factory = EnvironmentFactory(CounterEnv)
    # plain, async and static methods; not reset, get_reward, _private ones or properties
    assert sorted(factory.schemas) == ["double", "echo", "explode", "increment", "stall"]
    probe = factory.pool[0]
    assert factory.schemas["increment"] == get_json_schema(probe.increment)
    assert factory.schemas["increment"]["function"]["parameters"]["properties"] == {
        "step": {"type": "integer", "description": "How much to add."}}  # no self
    assert sorted(EnvironmentFactory(CalculatorEnv).schemas) == ["calculator"]
    assert EnvironmentFactory(CalculatorEnv).has_reward and not factory.has_reward


def test_named_by_import_path_or_class_path_with_init_args():
    assert EnvironmentFactory("tests.helpers.trl_envs:CalculatorEnv").cls is CalculatorEnv
    factory = EnvironmentFactory({"class_path": "tests.helpers.trl_envs:CounterEnv", "init_args": {"start": 5}})
    assert factory.pool[0].start == 5 and factory.take(2)[1].start == 5


@pytest.mark.parametrize("spec, message", [
    (NoToolsEnv, "NoToolsEnv has no public method, so the model would have no tool to call"),
    (UntypedEnv, "cannot build the JSON schema of tool method UntypedEnv.guess"),
    ("rlflow_env_guess:GuessNumber", "is an rlflow Environment (reset/step); name it in data.multiturn.environment"),
    (lambda: object(), "has no callable reset()"),
    ({"class_path": "tests.helpers.trl_envs:CounterEnv", "init_args": {"nope": 1}}, "CounterEnv() raised TypeError"),
])
def test_a_class_that_breaks_the_contract_is_refused_in_one_line(spec, message):
    with pytest.raises((ConfigError, PluginError)) as info:
        EnvironmentFactory(spec)
    text = str(info.value)
    assert message in text and "\n" not in text and text.startswith("data.multiturn.environment_factory: ")


def test_a_method_named_like_a_configured_tool_and_both_kinds_of_environment_are_refused(tmp_path):
    from rlflow.data.datamodule import RolloutDataModule
    from rlflow.data.settings import MultiTurnSettings
    from rlflow.tools.base import load_tools

    with pytest.raises(ConfigError, match="CalculatorEnv.calculator has the name of a tool of data.multiturn.tools"):
        EnvironmentFactory(CalculatorEnv, load_tools(["calculator"]))
    with pytest.raises(ConfigError, match="environment and data.multiturn.environment_factory are both set") as info:
        MultiTurnSettings(environment="guess_number", environment_factory="tests.helpers.trl_envs:CalculatorEnv")
    assert "\n" not in str(info.value)
    (tmp_path / "train.jsonl").write_text('{"prompt": "x", "ground_truth": "1"}\n')
    with pytest.raises(ConfigError, match="has no public method"):
        RolloutDataModule(train_data_path=str(tmp_path / "train.jsonl"),
                          multiturn={"environment_factory": "tests.helpers.trl_envs:NoToolsEnv"})


def test_reset_gets_the_row_and_its_text_is_appended_to_the_prompt_of_each_trajectory(tok):
    mt = MultiTurn(tok, {}, environment_factory=CounterEnv, max_turns=2)
    rec = record(tok, "Count.", list(mt.factory.schemas.values()), ground_truth="8", data_source="count")
    backend = ScriptedBackend(tok, [["done" + END]])
    (first, second), = mt.generate(backend, [rec], params(tok), n=2)
    hint = " (start at 0, answer 8)"
    expected = rec.prompt_text.replace("Count.", "Count." + hint)
    assert expected != rec.prompt_text and "# Tools" in expected  # the record's own rendering, tools included
    # every trajectory has its own prompt (reset may differ per instance), so the prefill is not shared
    assert backend.calls[0][0] == [tok.encode(expected, add_special_tokens=False)] * 2 and backend.calls[0][1] == 1
    assert first.prompt_ids == tok.encode(expected, add_special_tokens=False)
    assert rec.prompt == [{"role": "user", "content": "Count."}]  # reset got a copy
    assert first.info["environment"] is not second.info["environment"]


def test_a_plain_string_prompt_gets_the_observation_at_its_end(tok):
    mt = MultiTurn(tok, {}, environment_factory=CounterEnv, max_turns=1)
    rec = PromptRecord("Count:", {}, "rows.jsonl:1", tok.encode("Count:", add_special_tokens=False), "Count:")
    (c,), = mt.generate(ScriptedBackend(tok, [["x" + END]]), [rec], params(tok), n=1)
    assert c.prompt_ids == tok.encode("Count: (start at 0, answer None)", add_special_tokens=False)


def test_tool_calls_go_to_the_trajectorys_own_instance(tok):
    mt = MultiTurn(tok, {}, environment_factory=CounterEnv, max_turns=3)
    rec = record(tok, "Count.", list(mt.factory.schemas.values()))
    backend = ScriptedBackend(tok, [
        [call("increment", '{"step": 3}'), call("increment", '{"step": 5}')],
        [call("double"), call("echo", '{"text": "hi"}')],
        ["done" + END],
    ])
    (first, second), = mt.generate(backend, [rec], params(tok, 2000), n=2)
    one, two = first.info["environment"], second.info["environment"]
    assert (one.count, one.seen) == (6, ["+3"]) and (two.count, two.seen) == (5, ["+5"])
    assert [m["content"] for m in first.messages if m["role"] == "tool"] == ["3", "6"]
    assert [m["content"] for m in second.messages if m["role"] == "tool"] == ["5", "hi"]
    assert first.info["tool_calls"] == {"increment": 1, "double": 1}


def test_a_raising_or_hanging_method_is_a_failed_tool_call_and_a_timed_out_instance_leaves_the_pool(tok):
    mt = MultiTurn(tok, {}, environment_factory=CounterEnv, max_turns=2, tool_timeout=0.3)
    rec = record(tok, "Count.", list(mt.factory.schemas.values()))
    backend = ScriptedBackend(tok, [[call("explode", '{"x": 1}'), call("stall", '{"seconds": 3}'),
                                     call("missing"), call("increment", '{"step": 1}')], ["ok" + END]])
    (group,) = mt.generate(backend, [rec], params(tok), n=4)
    results = [c.messages[1]["content"] for c in group]
    assert "raised SystemExit: explode 1" in results[0]
    assert "timed out after 0.3 s" in results[1]
    assert "unknown tool 'missing'; available tools: double, echo, explode, increment, stall" in results[2]
    assert results[3] == "1" and all(c.messages[-1]["content"] == "ok" for c in group)  # the run went on
    m = multiturn_metrics(group)
    assert m["tools/failures/raised"] == 1 and m["tools/failures/timeout"] == 1
    assert m["tools/failures/unknown_tool"] == 1
    used = [c.info["environment"] for c in group]
    assert len(mt.factory.pool) == 3 and used[1] not in mt.factory.pool  # the stalled call may still change it
    again = mt.factory.take(4)
    assert again[:3] == [used[0], used[2], used[3]] and again[3] not in used


def test_instances_are_pooled_and_reset_per_rollout(tok):
    factory = EnvironmentFactory(CalculatorEnv)
    mt = MultiTurn(tok, {}, environment_factory=factory, max_turns=1)
    rec = record(tok, "7*6?", list(factory.schemas.values()), ground_truth="42")
    (a, b), = mt.generate(ScriptedBackend(tok, [["x" + END]]), [rec], params(tok), n=2)
    (c, d), = mt.generate(ScriptedBackend(tok, [["x" + END]]), [rec], params(tok), n=2)
    assert c.info["environment"] is a.info["environment"] and d.info["environment"] is b.info["environment"]
    assert a.info["environment"].resets == 2 and a.info["environment"].row["ground_truth"] == "42"
    assert len(factory.pool) == 2


def test_get_reward_is_the_env_reward_and_a_failing_one_counts_as_an_environment_failure(tok):
    class Rewarded(CalculatorEnv):
        def get_reward(self) -> float:
            if self.ground_truth == "boom":
                raise RuntimeError("no reward")
            return 2.0 if self.calls else 0.5

    mt = MultiTurn(tok, {}, environment_factory=Rewarded, max_turns=2)
    schemas = list(mt.factory.schemas.values())
    recs = [record(tok, "7*6?", schemas, ground_truth="42"), record(tok, "1*1?", schemas, ground_truth="boom")]
    backend = ScriptedBackend(tok, [[call("calculator", '{"expression": "7*6"}'), "42" + END, "1" + END],
                                    ["42" + END]])
    (first, second), (third,) = mt.generate(backend, recs, params(tok), n=2)[0], mt.generate(
        ScriptedBackend(tok, [["1" + END]]), recs[1:], params(tok), n=1)[0]
    assert first.messages[1]["content"] == "42" and first.env_reward == 2.0 and second.env_reward == 0.5
    assert third.env_reward is None and third.info["env_failed"] and multiturn_metrics([third])["env/failures"] == 1

    class Wrong(CalculatorEnv):
        def get_reward(self):
            return "high"

    with pytest.raises(PluginError, match="Wrong.get_reward\\(\\) returned 'high'"):
        MultiTurn(tok, {}, environment_factory=Wrong).generate(ScriptedBackend(tok, [["x" + END]]), recs[:1],
                                                              params(tok), n=1)


def test_a_reset_that_raises_or_returns_something_else_stops_the_run_naming_the_row(tok):
    class BadReset(CalculatorEnv):
        def reset(self, **kwargs):
            return 42 if kwargs.get("ground_truth") else 1 / 0

    mt = MultiTurn(tok, {}, environment_factory=BadReset, max_turns=1)
    rec = record(tok, "?", list(mt.factory.schemas.values()), ground_truth="1")
    with pytest.raises(PluginError, match="BadReset.reset returned a int on the row rows.jsonl:3"):
        mt.generate(ScriptedBackend(tok, [["x" + END]]), [rec], params(tok), n=1)
    with pytest.raises(PluginError, match="BadReset.reset raised ZeroDivisionError: division by zero on the row"):
        mt.generate(ScriptedBackend(tok, [["x" + END]]), [record(tok, "?", [])], params(tok), n=1)


# --------------------------------------------------------------------------------------- environments keyword
def judged(tok, completions, judgers):
    from rlflow.judgers.panel import JudgePanel

    panel = JudgePanel({"*": judgers}, None, [], timeout=10)
    panel.tokenizer = tok
    rec = PromptRecord([{"role": "user", "content": "?"}], {"ground_truth": "1"}, "rows.jsonl:1", [1], "?")
    return panel.judge([rec], completions, len(completions))[0]


def trajectory(tok, instance) -> Completion:
    info = {"turns": 1, "tool_calls": {}, "tool_failures": {}, "env_failed": False}
    if instance is not None:
        info["environment"] = instance
    return Completion(tok.encode("x", add_special_tokens=False), [0.0], "stop", mask=[True],
                      messages=[{"role": "assistant", "content": "x"}], info=info)


def test_judgers_get_the_environments_in_completion_order_only_if_they_take_them(tok):
    envs = [CalculatorEnv() for _ in range(3)]
    for i, env in enumerate(envs):
        env.calls, env.ground_truth = i * 2, str(i)
    result = judged(tok, [trajectory(tok, env) for env in envs], ["tests.helpers.trl_envs:tool_calls_reward",
                                                                  "tests.helpers.trl_envs:names_environments",
                                                                  "tests.helpers.trl_envs:no_environments"])
    assert result.per_judger["tool_calls_reward"] == [0.0, 2.0, 4.0]
    assert result.per_judger["names_environments"] == [3.0] * 3
    assert result.extra["env_ground_truth"] == ["0", "1", "2"]
    keywords = {name: stats.keywords for name, stats in result.judgers.items()}
    assert "environments" in keywords["tool_calls_reward"] and "environments" in keywords["names_environments"]
    assert keywords["no_environments"] == ("completions", "ground_truth")
    assert not any(stats.failed for stats in result.judgers.values())


def test_without_environments_the_keyword_is_absent(tok):
    result = judged(tok, [trajectory(tok, None)] * 2, ["tests.helpers.trl_envs:names_environments",
                                                       "tests.helpers.trl_envs:no_environments"])
    assert "environments" not in result.judgers["names_environments"].keywords
    assert result.judgers["names_environments"].failed == 2  # it requires the keyword: a failure, as in TRL
    assert result.per_judger["no_environments"] == [0.0, 0.0]


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_trajectorys_tools_keep_the_configured_timeout_and_isolation(isolation):
    from rlflow.environments.trl_factory import SharedLoopToolRunner
    from rlflow.tools.base import ToolRunner

    shared = ToolRunner({}, timeout=7.0, isolation=isolation)
    runner = SharedLoopToolRunner({}, shared)
    assert (runner.timeout, runner.isolation) == (7.0, isolation)
