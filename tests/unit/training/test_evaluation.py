"""Evaluation: pass@k against the binomial formula, per-source aggregation, maj@k, RNG isolation, judger failures."""


from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rlflow.data.datamodule import RolloutDataModule
from rlflow.judgers.base import Judger
from rlflow.training.evaluation import EvalMetrics, majority_correct, pass_at_k, pass_ks


class DigitJudger(Judger):
    """Reward 1 when the completion holds a digit (varies with sampling)."""

    name = "digit"

    def __init__(self, bonus: float = 0.0) -> None:
        self.bonus = bonus

    def score(self, completion: str, **sample) -> float:
        return float(any(ch.isdigit() for ch in completion))


def binomial_pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al. (2021): 1 - C(n-c, k) / C(n, k), with exact integers."""
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@pytest.mark.parametrize("n", [1, 2, 5, 10, 16])
def test_pass_at_k_matches_binomial_formula(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(binomial_pass_at_k(n, c, k), abs=1e-12)
    assert pass_at_k(4, 1, 1) == 0.25 and pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)


def test_pass_at_j_for_the_powers_of_two_below_k_by_hand():
    assert [pass_ks(k) for k in (1, 2, 3, 4, 5, 8, 12)] == [
        [], [2], [2, 3], [2, 4], [2, 4, 5], [2, 4, 8], [2, 4, 8, 12]]
    metrics = EvalMetrics(k=5, sources=["a"])
    metrics.update(["a", "a"], [[True, False, False, False, False], [False] * 5], [[1.0] + [0.0] * 4, [0.0] * 5],
                   [[1] * 5] * 2)
    m = metrics.compute()  # one prompt with 1 of 5 right: pass@j = j / 5; the other: 0
    assert m["eval/pass@2"] == pytest.approx(0.2) and m["eval/pass@4"] == pytest.approx(0.4)
    assert m["eval/pass@5"] == pytest.approx(0.5) and "eval/pass@8" not in m and "eval/pass@3" not in m


def by_hand_batches() -> list[tuple]:
    return [(["a", "b"], [[True, False], [False, False]], [[1.0, 0.0], [0.0, 0.5]], [[4, 6], [8, 10]]),
            (["a"], [[True, True]], [[1.0, 1.0]], [[2, 2]])]


def check_by_hand(m: dict[str, float]) -> None:
    # a: samples T F T T -> 3/4; pass@2 per prompt: 1 - C(1,2)/C(2,2) = 1, and 1 -> 1.0
    assert m["eval/a/accuracy"] == 0.75 and m["eval/a/pass@2"] == 1.0
    assert m["eval/b/accuracy"] == 0.0 and m["eval/b/pass@2"] == 0.0 and m["eval/b/reward"] == 0.25
    assert m["eval/accuracy"] == 3 / 6 and m["eval/pass@2"] == pytest.approx(2 / 3)
    assert m["eval/mean_length"] == (4 + 6 + 8 + 10 + 2 + 2) / 6
    assert m["eval/a/mean_length"] == 3.5


def test_eval_metrics_per_source_by_hand():
    metrics = EvalMetrics(k=2, sources=["a", "b"])
    for batch in by_hand_batches():
        metrics.update(*batch)
    check_by_hand(metrics.compute())


def test_eval_metrics_merge_like_ranks():
    """Two "ranks" each see one batch; merging their states (what torchmetrics' sync does across ranks, with the
    same ``cat`` reduction) gives the metrics of the whole eval set."""
    rank0, rank1 = EvalMetrics(k=2, sources=["a", "b"]), EvalMetrics(k=2, sources=["b", "a"])
    first, second = by_hand_batches()
    rank0.update(*first)
    rank1.update(*second)
    assert rank1.compute()["eval/accuracy"] == 1.0  # one rank alone is not the eval set
    rank0.merge_state(rank1)
    check_by_hand(rank0.compute())


def write_eval_file(tiny_data: Path, out: Path) -> dict[str, float]:
    """Six eval rows over two sources; returns the expected addition share per source (and overall)."""
    rows = [json.loads(line) for line in (tiny_data / "val.jsonl").read_text().splitlines()[:6]]
    for row in rows[4:]:
        row["data_source"] = "other/set"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    share = {}
    for source, part in (("openai/gsm8k", rows[:4]), ("other/set", rows[4:]), ("all", rows)):
        share[source] = sum("+" in r["extra_info"]["question"] for r in part) / len(part)
    return share


def test_eval_sampling_is_seeded_and_leaves_training_rng_alone(tiny_model, tiny_data, tmp_path):
    from transformers import AutoModelForCausalLM

    write_eval_file(tiny_data, tmp_path / "eval.jsonl")
    dm = RolloutDataModule(
        train_data_path=str(tiny_data / "train.jsonl"),
        eval_data_path=str(tmp_path / "eval.jsonl"),
        tokenizer_path=str(tiny_model),
        eval={"k": 2, "temperature": 1.0},
        sampling={"max_tokens": 8},
        judging={"judgers": {"*": DigitJudger()}},
    )
    dm.setup("validate")
    dm.bind(AutoModelForCausalLM.from_pretrained(tiny_model))
    torch.manual_seed(123)
    expected_next = torch.rand(4)
    torch.manual_seed(123)
    first = dm.evaluate(dm.eval_records, step=3, batch_idx=0)
    assert torch.equal(torch.rand(4), expected_next)  # evaluation did not move the global RNG
    again = dm.evaluate(dm.eval_records, step=3, batch_idx=0)
    assert first == again
    assert all(len(r) == 2 for r in first["rewards"]) and len(first["rewards"]) == 6
    other = dm.evaluate(dm.eval_records, step=4, batch_idx=0)
    assert other["lengths"] != first["lengths"] or other["rewards"] != first["rewards"]


def test_k_samples_need_a_temperature(tiny_data):
    with pytest.raises(ValueError, match=r"data\.eval\.k=4 with data\.eval\.temperature=0"):
        RolloutDataModule(train_data_path=str(tiny_data / "train.jsonl"), eval={"k": 4})


def test_eval_judger_failures_are_counted_by_hand():
    metrics = EvalMetrics(k=2, sources=["a"])
    metrics.update(
        ["a", "a"],
        [[True, False], [True, True]],
        [[1.0, 0.0], [1.0, 1.0]],
        [[3, 4], [5, 6]],
        [[False, True], [True, True]],
    )
    metrics.update(["a"], [[False, False]], [[0.0, 0.0]], [[1, 1]])  # no failures given: none
    m = metrics.compute()
    assert m["eval/judger_failures"] == 3.0 and m["eval/accuracy"] == 3 / 6


FAIL_ON: set[str] = set()


def fails_on_some_answers(completions, ground_truth, **kwargs):
    """A judger that fails (an infinite reward) on the prompts whose answer is in ``FAIL_ON``, 1.0 elsewhere."""
    return [float("inf") if str(t) in FAIL_ON else 1.0 for t in ground_truth]


def test_evaluate_flags_the_samples_a_judger_failed_on(tiny_model, tiny_data, tmp_path):
    from transformers import AutoModelForCausalLM

    write_eval_file(tiny_data, tmp_path / "eval.jsonl")
    dm = RolloutDataModule(
        train_data_path=str(tiny_data / "train.jsonl"),
        eval_data_path=str(tmp_path / "eval.jsonl"),
        tokenizer_path=str(tiny_model),
        eval={"k": 2, "temperature": 1.0},
        sampling={"max_tokens": 8},
        judging={"judgers": {"*": "tests.unit.training.test_evaluation:fails_on_some_answers"},
                 "isolation": "thread"},  # FAIL_ON is filled in this process
    )
    dm.setup("validate")
    dm.bind(AutoModelForCausalLM.from_pretrained(tiny_model))
    truths = [str(r.columns["ground_truth"]) for r in dm.eval_records]
    FAIL_ON.clear()
    FAIL_ON.update(truths[:2])
    out = dm.evaluate(dm.eval_records, step=0, batch_idx=0)
    expected = [[t in FAIL_ON] * 2 for t in truths]
    assert out["failed"] == expected and 0 < sum(map(sum, expected)) < 2 * len(truths)
    assert out["rewards"] == [[0.0 if f else 1.0 for f in fs] for fs in expected]  # scored without the failed judger


@pytest.mark.parametrize(
    "answers,correct,expected",
    [
        (["7", "3", "7", None], [True, False, True, False], True),  # 7 twice: right
        (["3", "7", "7", "3"], [False, True, True, False], False),  # a tie of 3 and 7: the first stated, 3, wrong
        (["7", "3", "3", "7"], [True, False, False, True], True),  # the same tie, 7 stated first
        ([None, None, "3", "3", "7"], [False, False, False, False, True], False),  # 3 beats the single right 7
        ([None, None], [False, False], False),  # no answer stated
        (["5"], [True], True),
    ],
)
def test_majority_vote_by_hand(answers, correct, expected):
    assert majority_correct(answers, correct) is expected


def test_majority_vote_refuses_mismatched_lengths():
    with pytest.raises(ValueError, match="2 answers for 3 samples"):
        majority_correct(["1", "2"], [True, False, True])


def test_eval_metrics_maj_at_k_by_hand():
    """Three prompts of source a (votes right, wrong, no judger answers), two of b (wrong: no answer stated; right),
    in two batches: maj@3 is 1/2 for a (the prompt without answers left out), 1/2 for b, 2/4 overall."""
    metrics = EvalMetrics(k=3, sources=["a", "b"])
    ones = [[1, 1, 1]] * 3
    metrics.update(
        ["a", "a", "b"],
        [[True, False, True], [True, False, False], [False, False, True]],
        [[1.0, 0.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0]],
        ones,
        answers=[["4", "2", "4"], ["4", "2", "2"], [None, None, None]],
    )
    metrics.update(
        ["a", "b"],
        [[True, True, False], [False, True, True]],
        [[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]],
        ones[:2],
        answers=[None, ["9", "8", "8"]],
    )
    m = metrics.compute()
    assert m["eval/maj@3"] == pytest.approx(2 / 4)
    assert m["eval/a/maj@3"] == pytest.approx(1 / 2) and m["eval/b/maj@3"] == pytest.approx(1 / 2)
    assert m["eval/accuracy"] == pytest.approx(8 / 15)
    only_without = EvalMetrics(k=3, sources=["a"])
    only_without.update(["a"], [[True, True, True]], [[1.0] * 3], ones[:1])  # no answers given at all
    assert "eval/maj@3" not in only_without.compute()
