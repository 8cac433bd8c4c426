"""The built-in judgers (math, think_format, overlong, function, the panel) and TRL reward functions by dotted path."""


from __future__ import annotations

import sys

import pytest

from rlflow import registry
from rlflow.judgers.function import FunctionJudger
from rlflow.judgers.runner import JudgerRunner

GROUP = "rlflow.judgers"


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


# ------------------------------------------------------------------------------------------------- math
def test_math_matches_trls_accuracy_reward_examples():
    judger = registry.build(GROUP, "math")
    completions = [
        chat(r"My answer is \boxed{\frac{1}{3}}"),  # TRL's docstring example: 1.0
        chat(r"My answer is \boxed{\frac{1}{2}}"),  # and 0.0
        chat(r"so it is \boxed{0.5}"),  # symbolic equality: 1/2 == 0.5
        chat("The final answer is $72$."),  # LaTeX with an anchor phrase
        chat("#### 72"),  # GSM8K's format is not LaTeX: no answer found
        chat(r"\boxed{3}"),  # the reference is not math: None, skipped
    ]
    truths = [r"\frac{1}{3}", r"\frac{1}{3}", r"\frac{1}{2}", "72", "72", "hello world"]
    assert judger(prompts=["p"] * 6, completions=completions, ground_truth=truths) == [1.0, 0.0, 1.0, 1.0, 0.0, None]
    # TRL's column name works too, and numbers as references
    assert judger(prompts=["p"], completions=[chat(r"\boxed{1,000}")], solution=[1000]) == [1.0]
    # a list reference holds acceptable answers: any of them scores
    lists = [[r"\frac{1}{2}", "7"], ["7", "8"], ["hello", "world"]]
    assert judger(prompts=["p"] * 3, completions=[chat(r"\boxed{0.5}")] * 3, ground_truth=lists) == [1.0, 0.0, None]


def test_math_without_the_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes `import math_verify` raise ImportError
    with pytest.raises(ImportError, match=r"rlflow\[math\]"):
        registry.build(GROUP, "math")


# ------------------------------------------------------------------------------------------ think_format
@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>\nreasoning\n</think>\nThe answer is 4.", 1.0),  # TRL's example
        ("  <think>r</think>4", 1.0),  # leading whitespace is fine
        ("<think>\nreasoning\nThe answer is 4.", 0.0),  # never closed
        ("<think>r</think>", 0.0),  # no answer after the block
        ("<think>r</think>   \n", 0.0),
        ("answer first <think>r</think> 4", 0.0),  # does not start with the block
        ("<think>a<think>b</think>4", 0.0),  # nested opening tag
        ("<think>a</think>4</think>5", 0.0),  # two closing tags
    ],
)
def test_think_format(text, expected):
    judger = registry.build(GROUP, "think_format")
    assert judger(prompts=["p"], completions=[chat(text)]) == [expected]


def test_think_format_options():
    in_prompt = registry.build(GROUP, {"class_path": "think_format", "init_args": {"think_in_prompt": True}})
    assert in_prompt(prompts=["p", "p"], completions=["reasoning</think>42", "<think>r</think>42"]) == [1.0, 0.0]
    lenient = registry.build(
        GROUP, {"class_path": "think_format", "init_args": {"require_answer": False, "wrong_score": -1}}
    )
    assert lenient(prompts=["p", "p"], completions=["<think>r</think>", "r"]) == [1.0, -1.0]


# ---------------------------------------------------------------------------------------------- overlong
def dapo_soft_overlong(length: int, l_max: int, l_cache: int) -> float:
    """DAPO Eq. 13, written out case by case from the paper."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


def test_overlong_is_dapos_soft_punishment():
    judger = registry.build(GROUP, {"class_path": "overlong", "init_args": {"buffer_tokens": 20}}, max_tokens=100)
    lengths = [0, 50, 80, 81, 90, 99, 100, 101]
    out = judger(prompts=["p"] * 8, completions=["c"] * 8, completion_ids=[[7] * n for n in lengths])
    # hand-computed: 0 up to 80 tokens, then -1/20 per token, -1 at and over the budget
    assert out == pytest.approx([0.0, 0.0, 0.0, -0.05, -0.5, -0.95, -1.0, -1.0])
    assert out == pytest.approx([dapo_soft_overlong(n, 100, 20) for n in lengths])
    scaled = registry.build(
        GROUP, {"class_path": "overlong", "init_args": {"buffer_tokens": 20, "penalty_factor": 0.5}}, max_tokens=100
    )
    assert scaled(completion_ids=[[1] * 90]) == [-0.25]


def test_overlong_checks_its_arguments():
    with pytest.raises(ValueError, match="needs max_tokens"):
        registry.build(GROUP, "overlong")
    with pytest.raises(ValueError, match="buffer_tokens=200"):
        registry.build(GROUP, {"class_path": "overlong", "init_args": {"buffer_tokens": 200}}, max_tokens=100)
    assert registry.build(GROUP, "overlong", max_tokens=12).buffer_tokens == 2  # a fifth of the budget, as DAPO


# ---------------------------------------------------------------------------------------------- function
def test_function_judger_runs_a_trl_reward_function_unchanged():
    judger = registry.build(GROUP, {"class_path": "function",
                                    "init_args": {"path": "tests.helpers.reward_helpers:reward_len"}})
    assert judger.name == "reward_len"  # TRL's metric name is the function's __name__
    assert judger(prompts=["p", "p"], completions=[chat("abcde"), chat("ab")], completion_ids=[[1], [2]]) == [0.0, -0.3]


def test_function_judger_factory_rename_and_errors():
    contains = FunctionJudger("tests.helpers.reward_helpers:make_reward_contains", factory_kwargs={"char": "7"})
    assert contains.name == "reward_contains"
    assert contains(completions=["a7", "b"]) == [1.0, 0.0]
    echo = FunctionJudger("tests.helpers.reward_helpers:solution_echo", rename={"solution": "ground_truth"},
                          name="echo")
    assert echo.name == "echo" and echo(completions=["a", "b"], ground_truth=["1", "2.5"]) == [1.0, 2.5]
    with pytest.raises(KeyError, match="'ground_truth', which the data lacks"):
        echo(completions=["a"], answer=["1"])
    with pytest.raises(registry.PluginError, match="no attribute"):
        FunctionJudger("tests.helpers.reward_helpers:nope")
    with pytest.raises(TypeError, match="not a callable"):
        FunctionJudger("tests.helpers.reward_helpers:__doc__")


def test_trl_functions_by_dotted_path_in_the_runner_including_async():
    runner = JudgerRunner({"*": ["tests.helpers.reward_helpers:reward_len",
                                 "tests.helpers.reward_helpers.async_reward_one",
                                 {"class_path": "function",
                                  "init_args": {"path": "tests.helpers.reward_helpers:async_reward_one"},
                                  "name": "again"}]})
    result = runner.judge(["p", "p"], [chat("abcde"), chat("abcdefg")], [[1], [2]], {"data_source": ["x", "x"]})
    assert result.per_judger == {"reward_len": [0.0, -0.2], "async_reward_one": [1.0, 1.0], "again": [1.0, 1.0]}
    assert result.rewards == pytest.approx([2.0, 1.8])


# ------------------------------------------------------------------------------------ stated answers (maj@k)
def test_math_and_gsm8k_state_the_answer_they_score():
    """``answer`` (for eval/maj@k) is what ``score`` compares: gsm8k's last ``#### <number>`` without ``,``/``$``;
    math's parsed form, equal for forms math-verify brings to one."""
    gsm8k, math = registry.build(GROUP, "gsm8k"), registry.build(GROUP, "math")
    assert [gsm8k.answer(t) for t in ["so #### 1,234", "#### 3 then #### 5", "no answer", "####7"]] == [
        "1234", "5", None, None]
    assert math.answer(r"it is \boxed{\frac{2}{4}}") == math.answer(r"\boxed{\frac{1}{2}}") == "1/2"
    assert math.answer("#### 72") is None  # not LaTeX: math states no answer, as it scores none
    assert math.answer(r"\boxed{0.5}") != math.answer(r"\boxed{\frac{1}{2}}")  # left apart (the documented limit)


class Shouting:
    """A judger without ``answer``."""

    def __call__(self, prompts, completions, **kwargs):
        return [1.0] * len(completions)


class Raising:
    """A judger whose ``answer`` raises on texts holding 'x'."""

    name = "raising"

    def __call__(self, prompts, completions, **kwargs):
        return [0.0] * len(completions)

    def answer(self, text):
        if "x" in text:
            raise RuntimeError("cannot read x")
        return text[:1]


def test_panel_takes_answers_from_the_first_judger_of_a_row_that_states_them(caplog):
    from rlflow.data.dataset import PromptRecord
    from rlflow.judgers.panel import JudgePanel

    panel = JudgePanel({"a": [{"class_path": "tests.unit.judgers.test_judgers.Shouting"}, "gsm8k"],
                        "b": [{"class_path": "tests.unit.judgers.test_judgers.Raising"}, "gsm8k"],
                        "c": {"class_path": "tests.unit.judgers.test_judgers.Shouting"}}, None, [])
    records = [PromptRecord("p", {"data_source": s}, f"t.jsonl:{i}") for i, s in enumerate("abc", 1)]
    texts = ["#### 1", "#### 2", "none", "x #### 1", "y #### 2", "", "#### 1", "#### 2", "#### 3"]
    with caplog.at_level("WARNING"):
        answers = panel.answers(records, texts, 3)
    assert answers == [["1", "2", None], [None, "y", ""], None]  # b: Raising first; its failure is no answer
    assert sum("Raising.answer raised RuntimeError" in r.message for r in caplog.records) == 1

