"""TRL's reward keywords (``trainer_state``, ``log_extra``, ``log_metric``) reach every judger call; a judger without
``**kwargs`` gets only the keywords it names; what judgers log lands at its samples' positions."""

from __future__ import annotations

import math

import pytest

from rlflow.judgers.context import JudgerLogs, RunState, accepted_keywords, plain, run_state, select_keywords
from rlflow.judgers.function import FunctionJudger
from rlflow.judgers.panel import SourceJudgers
from rlflow.judgers.runner import JudgerRunner

SEEN: dict[str, dict] = {}


def trl_curriculum(prompts, completions, completion_ids, trainer_state, log_extra, log_metric, **kwargs):
    """TRL's documented signature: a reward that grows with ``trainer_state.global_step``."""
    SEEN["trl_curriculum"] = {"state": trainer_state, "kwargs": sorted(kwargs)}
    level = trainer_state.global_step / trainer_state.max_steps
    log_extra("level", [level] * len(completions))
    log_extra("text_length", [len(c) for c in completions])
    log_metric("curriculum/level", level)
    return [level] * len(completions)


def narrow(completions, solution):
    """No ``**kwargs``: TRL would pass it keywords it does not take; rlflow passes only these two."""
    return [float(c == s) for c, s in zip(completions, solution)]


def batch(sources=("a", "b", "a", "b")):
    n = len(sources)
    return ([f"p{i}" for i in range(n)], [str(i) for i in range(n)], [[i] * (i + 1) for i in range(n)],
            {"data_source": list(sources), "solution": ["0", "9", "2", "9"][:n]})


def test_every_call_gets_trl_keywords_and_its_log_calls_land_at_its_samples():
    runner = JudgerRunner({"a": [trl_curriculum, narrow], "b": [narrow]}, isolation="thread")  # SEEN: here
    state = RunState(global_step=3, max_steps=4)
    result = runner.judge(*batch(), state=state)
    assert SEEN["trl_curriculum"]["state"] is state  # the step context, passed through as given
    assert SEEN["trl_curriculum"]["kwargs"] == ["data_source", "solution"]  # the columns; the rest are named
    assert result.per_judger["trl_curriculum"] == [0.75, None, 0.75, None]  # routed to source a only
    assert result.per_judger["narrow"] == [1.0, 0.0, 1.0, 0.0]
    # log_extra values sit at the positions of the samples the call judged; None elsewhere
    assert result.extra == {"level": [0.75, None, 0.75, None], "text_length": [1, None, 1, None]}
    assert result.logged == {"curriculum/level": [0.75]}
    assert result.judgers["narrow"].keywords == ("completions", "solution")
    assert set(result.judgers["trl_curriculum"].keywords) >= {"trainer_state", "log_extra", "log_metric", "prompts"}


def test_outside_a_run_judgers_get_the_state_before_training():
    runner = JudgerRunner({"*": [trl_curriculum, narrow]}, isolation="thread")
    assert runner.judge(*batch(("a",))).rewards == [0.0 + 1.0]  # step 0 of 1: a curriculum does not divide by 0
    assert SEEN["trl_curriculum"]["state"] == RunState(max_steps=1, num_train_epochs=1)
    # any caller's job (rlflow data check probes judgers through call_all) gets the keywords a judger takes too
    job = {"prompts": ["p"], "completions": ["0"], "completion_ids": [[0]], "solution": ["0"]}
    out = runner.call_all({"trl_curriculum": dict(job), "narrow": dict(job)})
    assert out == {"trl_curriculum": ([0.0], None), "narrow": ([1.0], None)}


def test_a_log_extra_of_the_wrong_length_or_a_non_number_metric_fails_that_judger():
    def short_extra(completions, log_extra, **kwargs):
        log_extra("x", [1])
        return [1.0] * len(completions)

    def text_metric(completions, log_metric, **kwargs):
        log_metric("m", "high")
        return [1.0] * len(completions)

    result = JudgerRunner({"*": [short_extra, text_metric]}).judge(*batch())
    assert result.judgers["short_extra"].failed == 4 and "got 1 values for the call's 4" in \
        result.judgers["short_extra"].error
    assert result.judgers["text_metric"].failed == 4
    assert result.judgers["text_metric"].error.startswith("ValueError: log_metric('m', ...) needs a number, got str "
                                                          "'high'")


def test_log_extra_values_that_are_not_json_are_kept_as_text():
    logs = JudgerLogs(3)
    logs.keywords([2, 0], RunState())["log_extra"]("parsed", [{1, 2}, "a"])
    assert logs.extra == {"parsed": ["a", None, "{1, 2}"]}
    assert plain([1, "x", None]) == [1, "x", None] and plain(math.inf) == math.inf


def test_a_judger_abandoned_after_its_timeout_logs_nothing_into_the_judged_batch():
    logs = JudgerLogs(2)
    late = logs.keywords([0, 1], RunState())
    logs.close()
    late["log_extra"]("x", [1, 2])
    late["log_metric"]("m", 1.0)
    assert logs.extra == {} and logs.metrics == {}


def test_accepted_keywords():
    assert accepted_keywords(trl_curriculum) is None  # **kwargs: everything
    assert accepted_keywords(narrow) == {"completions", "solution"}

    def kw_only(*, completions, trainer_state=None):
        return []

    assert accepted_keywords(kw_only) == {"completions", "trainer_state"}
    assert select_keywords({"a": 1, "b": 2}, frozenset({"b"})) == {"b": 2}
    assert select_keywords({"a": 1}, None) == {"a": 1}


def test_function_judger_renames_then_passes_what_the_function_takes():
    judger = FunctionJudger("tests.unit.judgers.test_trl_keywords:narrow", rename={"solution": "ground_truth"})
    runner = JudgerRunner({"*": judger})
    result = runner.judge(["p", "q"], ["3", "4"], [[1], [2]], {"ground_truth": ["3", "5"]}, state=RunState())
    assert result.rewards == [1.0, 0.0] and result.judgers["narrow"].failed == 0


def test_mixed_sources_merge_what_judgers_log_and_their_counts():
    routing = SourceJudgers({"*": [trl_curriculum]}, None, [])
    routing.runners["own"] = JudgerRunner({"*": [narrow]})
    result = routing.judge(["own", "x", "own", "x"], *batch(), state=RunState(global_step=1, max_steps=2))
    assert result.extra["level"] == [None, 0.5, None, 0.5]
    assert result.logged == {"curriculum/level": [0.5]}
    assert (result.judgers["narrow"].samples, result.judgers["trl_curriculum"].samples) == (2, 2)


@pytest.mark.parametrize(("max_steps", "max_epochs", "per_epoch", "expected"), [
    (6, -1, 4, (6, 2)),  # bounded by steps: epochs derived (TRL's num_train_epochs)
    (-1, 2, 4, (8, 2)),  # bounded by epochs: steps derived
    (10, 2, 4, (8, 2)),  # both: the first bound reached
])
def test_run_state_fills_trl_fields(max_steps, max_epochs, per_epoch, expected):
    state = run_state(3, max_steps, max_epochs, per_epoch, rank=1, local_rank=0)
    assert (state.max_steps, state.num_train_epochs) == expected
    assert state.global_step == 3 and state.epoch == 3 / per_epoch
    assert not state.is_world_process_zero and state.is_local_process_zero


def test_trainer_state_has_every_field_of_transformers_trainer_state():
    """A TRL reward function may read any TrainerState field (``state.logging_steps``, ``state.best_metric``...)."""
    import dataclasses

    transformers = pytest.importorskip("transformers")
    theirs = {f.name: f for f in dataclasses.fields(transformers.TrainerState)}
    ours = {f.name: f for f in dataclasses.fields(RunState)}
    assert set(theirs) <= set(ours), sorted(set(theirs) - set(ours))
    reference, state = transformers.TrainerState(), RunState()
    for name in set(theirs) - {"log_history", "global_step", "max_steps", "epoch", "num_train_epochs"}:
        assert getattr(state, name) == getattr(reference, name), name  # its defaults, where rlflow has no value
