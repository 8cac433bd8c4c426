"""Unit tests of the example Countdown judger (run: python -m pytest plugins/rlflow-judger-example/tests)."""

from fractions import Fraction

import pytest
from rlflow_judger_example.countdown import CountdownJudger, NotAnEquation, evaluate


def judge(text, target=60, numbers=(3, 5, 25), **kwargs):
    judger = CountdownJudger(**kwargs)
    return judger(prompts=["p"], completions=[text], target=[target], numbers=[list(numbers)])[0]


def test_correct_equation_scores_one():
    assert judge("I think <answer>(25 - 5) * 3</answer>") == 1.0
    # chat layout (TRL's completions) works too
    out = CountdownJudger()(prompts=["p"],
                            completions=[[{"role": "assistant", "content": "<answer>3*(25-5)</answer>"}]],
                            target=[60], numbers=[[3, 5, 25]])
    assert out == [1.0]


def test_wrong_value_or_wrong_numbers_get_format_score():
    assert judge("<answer>25 + 5 + 3</answer>") == 0.1  # = 33, wrong value
    assert judge("<answer>(25 - 5) * 3 * 1</answer>") == 0.1  # uses 1, which is not given
    assert judge("<answer>20 * 3</answer>") == 0.1  # = 60 but uses 20 instead of 25 and 5
    assert judge("<answer>25 * 3 - 15</answer>", target=60) == 0.1


def test_no_answer_or_not_an_equation_scores_zero():
    assert judge("(25 - 5) * 3") == 0.0
    assert judge("<answer>__import__('os')</answer>") == 0.0
    assert judge("<answer>25 ** 5 ** 3</answer>") == 0.0
    assert judge("<answer>3 / (5 - 5) + 25</answer>") == 0.0


def test_last_answer_wins_and_exact_fractions():
    assert judge("<answer>25+5+3</answer> no wait <answer>(25-5)*3</answer>") == 1.0
    value, used = evaluate("1 / 3 * 3")
    assert value == Fraction(1) and used == [1, 3, 3]
    # 10 / 4 = 2.5 exactly, target 5 with 2 * 2.5
    assert judge("<answer>10 / 4 * 2</answer>", target=5, numbers=(2, 4, 10)) == 1.0


def test_use_all_numbers_off_allows_leaving_one_out():
    assert judge("<answer>20 * 3</answer>", numbers=(3, 20, 7)) == 0.1
    assert judge("<answer>20 * 3</answer>", numbers=(3, 20, 7), use_all_numbers=False) == 1.0
    assert judge("<answer>20 * 3 * 3 / 3</answer>", numbers=(3, 20, 7), use_all_numbers=False) == 0.1  # 3 used thrice


def test_tinyzero_columns_and_missing_columns():
    j = CountdownJudger()
    assert j(prompts=["p"], completions=["<answer>(25-5)*3</answer>"], nums=[[3, 5, 25]], target=[60]) == [1.0]
    assert j(prompts=["p"], completions=["<answer>(25-5)*3</answer>"],
             ground_truth=[{"target": 60, "numbers": [3, 5, 25]}]) == [1.0]
    with pytest.raises(ValueError, match="'target' and 'numbers'"):
        j(prompts=["p"], completions=["<answer>1</answer>"], ground_truth=["60"])


def test_evaluate_rejects_names_and_calls():
    for bad in ("x + 1", "abs(-3)", "1 if 1 else 2", "[1, 2]", "1.5 * 2"):
        with pytest.raises(NotAnEquation):
            evaluate(bad)
