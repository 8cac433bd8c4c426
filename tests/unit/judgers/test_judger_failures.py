"""A judger that cannot work is told apart from one that fails now and then (:meth:`JudgeResult.problem`); a
judger raising ``SystemExit`` or ``KeyboardInterrupt`` is a failure, and no wait for judgers is unbounded."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rlflow.judgers import runner as runner_module
from rlflow.judgers.runner import JudgeResult, JudgerRunner, JudgerStats

RELEASE = threading.Event()


def wrong_signature(completion, **kwargs):
    """A TRL user's slip: ``completion`` for ``completions``."""
    return [1.0]


def ok(completions, **kwargs):
    return [1.0] * len(completions)


def every_fourth_inf(completions, completion_ids, **kwargs):
    return [float("inf") if len(ids) % 4 == 0 else 0.5 for ids in completion_ids]


def batch(n=8):
    return [f"p{i}" for i in range(n)], [f"c{i}" for i in range(n)], [[0] * (i + 1) for i in range(n)], \
        {"ground_truth": [str(i) for i in range(n)]}


def test_a_judger_failing_on_every_sample_is_a_problem_naming_it_the_exception_and_keywords():
    result = JudgerRunner({"*": [ok, wrong_signature]}).judge(*batch())
    problem = result.problem()
    assert problem.startswith("judger 'wrong_signature' failed on 8 of its 8 samples: TypeError: ")
    assert "missing 1 required positional argument: 'completion'" in problem
    assert problem.endswith("it was given the keywords prompts, completions, completion_ids, ground_truth, "
                            "trainer_state, log_extra, log_metric")
    assert "\n" not in problem


def test_sporadic_failures_are_no_problem_unless_over_the_rate():
    result = JudgerRunner({"*": [ok, every_fourth_inf]}).judge(*batch())  # lengths 4 and 8 fail: 2 of 8
    assert result.judgers["every_fourth_inf"] == JudgerStats(8, 2, result.judgers["every_fourth_inf"].error,
                                                             result.judgers["every_fourth_inf"].keywords)
    assert result.problem() is None and result.problem(0.25) is None  # 2 of 8 is not more than a quarter
    assert "failed on 2 of its 8 samples (more than data.judging.max_failure_rate=0.2)" in result.problem(0.2)
    assert "ValueError: it returned inf for 2 sample(s)" in result.problem(0.0)


def test_rewards_all_missing_through_failures_are_a_problem():
    """Each judger fails on half of the samples, a different half: no sample has a reward."""
    result = JudgeResult([0.0] * 4, {"a": [None] * 4, "b": [None] * 4}, {"judger/unscored": 4.0},
                         judgers={"a": JudgerStats(4, 2, "E: a"), "b": JudgerStats(4, 2, "E: b")})
    assert result.problem().startswith("no judger scored any of the 4 samples, so every reward would be missing")
    unscored_only = JudgeResult([0.0] * 4, {"a": [None] * 4}, {"judger/unscored": 4.0}, judgers={"a": JudgerStats(4)})
    assert unscored_only.problem() is None  # "not applicable" everywhere is not a failure


def raises_system_exit(completions, **kwargs):
    raise SystemExit(3)


def raises_keyboard_interrupt(completions, **kwargs):
    raise KeyboardInterrupt


async def async_system_exit(completions, **kwargs):
    await asyncio.sleep(0)
    raise SystemExit(4)


@pytest.mark.parametrize("judger", [raises_system_exit, raises_keyboard_interrupt, async_system_exit])
def test_base_exceptions_inside_a_judger_are_failures_not_hangs(judger):
    runner = JudgerRunner({"*": [judger, ok]}, timeout=None)  # no timeout: only the fix keeps this from hanging
    done: list = []
    worker = threading.Thread(target=lambda: done.append(runner.judge(*batch(2))), daemon=True)
    worker.start()
    worker.join(60)  # a hang is forever; a busy machine may take seconds to start the judger's worker process
    assert done, "judging hung"
    result = done[0]
    assert result.rewards == [1.0, 1.0] and result.judgers[judger.__name__].failed == 2
    assert result.judgers[judger.__name__].error.split(":")[0] in ("SystemExit", "KeyboardInterrupt")
    assert runner.judge(*batch(1)).rewards == [1.0]  # the runner's loops still work


def hung(completions, **kwargs):
    RELEASE.wait(30)
    return [1.0] * len(completions)


def test_a_timed_out_thread_is_counted_while_it_runs():
    RELEASE.clear()
    runner = JudgerRunner({"*": [hung, ok]}, timeout=0.2, isolation="thread")  # a thread is abandoned
    try:
        result = runner.judge(*batch(2))
        assert result.metrics["judger/abandoned_threads"] >= 1
        assert result.judgers["hung"].error.startswith("JudgerTimeout")
    finally:
        RELEASE.set()
    deadline = time.monotonic() + 5
    while runner_module.abandoned_threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runner_module.abandoned_threads() == 0


@pytest.mark.filterwarnings("ignore:coroutine 'JudgerRunner._call_all' was never awaited")
def test_the_wait_for_a_batch_is_bounded_even_if_the_event_loop_is_stuck(monkeypatch):
    monkeypatch.setattr(runner_module, "GRACE", 0.2)
    runner = JudgerRunner({"*": [ok]}, timeout=0.2, isolation="thread")  # the loop alone: no worker to start
    stuck = asyncio.new_event_loop()  # nobody runs it: what a dead loop thread leaves behind
    runner._loop = stuck
    t0 = time.perf_counter()
    result = runner.judge(*batch(2))
    assert time.perf_counter() - t0 < 3
    assert result.judgers["ok"].failed == 2 and "event loop did not answer" in result.judgers["ok"].error
    assert runner.judge(*batch(2)).rewards == [1.0, 1.0]  # the next batch gets a fresh loop
    stuck.close()


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no message for you")


def raises_unprintable(completions, **kwargs):
    raise Unprintable()


def test_an_exception_whose_message_cannot_be_read_is_a_failure_in_the_trainer_too():
    runner = JudgerRunner({"*": [raises_unprintable, ok]}, isolation="thread")
    result = runner.judge(*batch(2))
    assert result.rewards == [1.0, 1.0] and result.judgers["raises_unprintable"].failed == 2
    assert result.judgers["raises_unprintable"].error == "Unprintable (its message could not be read: RuntimeError)"
