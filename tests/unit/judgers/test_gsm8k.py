"""The GSM8K judger against verl's/XTuner's semantics, edge case by edge case."""

from __future__ import annotations

import pytest

from rlflow import registry
from rlflow.judgers.gsm8k import GSM8KJudger, extract_answer


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so 48 + 24 = 72\n#### 72", "72"),
        ("#### 1,234", "1234"),  # thousands separator removed
        ("#### $72", None),  # the strict pattern wants a digit right after '#### '
        ("####72", None),  # no space: not the strict format
        ("#### 72.", "72."),  # the trailing dot is captured, so it will not equal '72'
        ("#### 10\nwait, no\n#### 12", "12"),  # the last match wins
        ("the answer is 72", None),  # none
        ("#### -5", "-5"),
        ("#### 3.50", "3.50"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_only_last_300_characters_are_searched():
    early = "#### 72\n" + "x" * 300
    assert extract_answer(early) is None
    assert extract_answer("#### 72" + "x" * 292) == "72"  # 7 + 292 = 299 characters: still inside


@pytest.mark.parametrize(
    "completion, truth, reward",
    [
        ("#### 72", "72", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("#### $72", "72", 0.0),
        ("####72", "72", 0.0),
        ("#### 72.", "72", 0.0),
        ("#### 10 then #### 72", "72", 1.0),
        ("#### 72 then #### 10", "72", 0.0),
        ("no answer", "72", 0.0),
        # ground truths written the ways data tools write them: the number the completion states
        ("#### 72", 72.0, 1.0),  # a pandas integer column with a missing value is float
        ("#### 72", 72, 1.0),
        ("#### 1,000", "1,000", 1.0),
        ("#### 72", 72.5, 0.0),
        ("#### 72", " 72 ", 1.0),
    ],
)
def test_scores(completion, truth, reward):
    judger = GSM8KJudger()
    out = judger(prompts=["q"], completions=[completion], completion_ids=[[1]], ground_truth=[truth])
    assert out == [reward]


def test_a_list_ground_truth_holds_acceptable_answers():
    judger = GSM8KJudger(format_score=0.1)
    out = judger(prompts=["q"] * 3, completions=["#### 72", "#### 8", "#### 9"], completion_ids=[[1]] * 3,
                 ground_truth=[["72", "8"], [8, 72], ["72"]])
    assert out == [1.0, 1.0, 0.1]


def test_scores_are_configurable_and_chat_completions_work():
    judger = GSM8KJudger(score=2.0, format_score=0.1, missing_score=-1.0)
    completions = [[{"role": "assistant", "content": c}] for c in ("#### 7", "#### 8", "nothing")]
    out = judger(prompts=[[{"role": "user", "content": "q"}]] * 3, completions=completions,
                 completion_ids=[[1]] * 3, ground_truth=["7", "7", "7"])
    assert out == [2.0, 0.1, -1.0]


def test_missing_ground_truth_is_a_clear_error():
    with pytest.raises(ValueError, match="ground_truth"):
        GSM8KJudger()(prompts=["q"], completions=["#### 1"], completion_ids=[[1]])


def test_registered_under_entry_point():
    assert registry.load("rlflow.judgers", "gsm8k") is GSM8KJudger


def test_real_gsm8k_reference_answers_score_one():
    """Every reference solution of the example data scores 1.0 against its own ground truth."""
    import json

    from tests.helpers.paths import DATA

    rows = [json.loads(l) for l in (DATA / "train_example.jsonl").read_text().splitlines()]
    judger = GSM8KJudger()
    out = judger(prompts=[r["prompt"] for r in rows], completions=[r["extra_info"]["answer"] for r in rows],
                 completion_ids=[[0]] * len(rows), ground_truth=[r["reward_model"]["ground_truth"] for r in rows])
    assert len(rows) >= 199 and out == [1.0] * len(rows)
