"""JudgerRunner: routing, weights and None-skipping against hand-computed rewards; concurrency; timeouts;
failures; contract errors."""

from __future__ import annotations

import asyncio
import logging
import math
import pickle
import threading
import time

import numpy as np
import pytest
import torch

from rlflow import registry
from rlflow.judgers.runner import JudgerRunner

LOGGER = "rlflow.judgers.runner"
CALLS: dict[str, list[dict]] = {}


def table_judger(name: str, table: dict[str, float | None]):
    """A TRL-style reward function that looks each completion up in ``table`` and records its keyword args."""

    def judge(prompts, completions, completion_ids, **columns):
        CALLS[name] = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
        return [table[c] for c in completions]

    judge.__name__ = name
    return judge


J1 = table_judger("j1", {"c0": 1.0, "c1": None, "c4": math.nan})
J2 = table_judger("j2", {"c0": 4.0, "c1": 2.0, "c2": None, "c4": 6.0})
J3 = table_judger("j3", {"c3": 3.0})


def batch(n: int = 5, sources=("a", "a", "b", "c", "a")):
    completions = [f"c{i}" for i in range(n)]
    columns = {"data_source": list(sources[:n]), "ground_truth": [str(i) for i in range(n)]}
    return [f"p{i}" for i in range(n)], completions, [[i] * (i + 1) for i in range(n)], columns


def test_weighted_routed_none_skipping_against_hand_computed_rewards():
    runner = JudgerRunner({"a": [J1, J2], "b": [J2], "*": [J3]}, reward_weights={"j1": 2.0, "j2": 0.5, "j3": -1.0},
                           isolation="thread")  # CALLS records what each judger saw, in this process
    result = runner.judge(*batch())
    # s0: 2*1 + 0.5*4 = 4 | s1: j1 None, 0.5*2 = 1 | s2: j2 None, nothing else applies -> 0 (unscored)
    # s3: source c -> '*' -> -1*3 = -3 | s4: j1 NaN is skipped like None, 0.5*6 = 3
    assert result.rewards == [4.0, 1.0, 0.0, -3.0, 3.0]
    assert result.per_judger == {
        "j1": [1.0, None, None, None, None],
        "j2": [4.0, 2.0, None, None, 6.0],
        "j3": [None, None, None, 3.0, None],
    }
    m = result.metrics
    assert m["judger/unscored"] == 1.0 and m["judger/failures"] == 0.0
    assert result.failed == [()] * len(result.rewards)  # None from a judger that did not fail: not applicable
    # TRL's per-function metrics; std is the sample std: j2 scored 4, 2, 6 -> mean 4, sqrt((0+4+4)/2) = 2
    assert m["rewards/j2/mean"] == 4.0 and m["rewards/j2/std"] == 2.0
    assert m["rewards/j1/mean"] == 1.0 and m["rewards/j1/std"] == 0.0
    assert m["rewards/j3/mean"] == 3.0
    # each judger saw only its routed samples, with TRL's keywords and every column sliced alike
    assert CALLS["j1"]["completions"] == ["c0", "c1", "c4"] and CALLS["j1"]["ground_truth"] == ["0", "1", "4"]
    assert CALLS["j2"]["prompts"] == ["p0", "p1", "p2", "p4"] and CALLS["j2"]["completion_ids"][2] == [2, 2, 2]
    assert CALLS["j3"]["data_source"] == ["c"]


def test_one_spec_on_two_routes_is_one_judger_and_a_second_name_gets_a_number(caplog):
    runner = JudgerRunner({"a": "gsm8k", "b": ["gsm8k"]})
    assert list(runner.judgers) == ["gsm8k"] and runner.routes == {"a": ["gsm8k"], "b": ["gsm8k"]}
    length = "tests.helpers.reward_helpers:reward_len"
    twice = [{"class_path": "function", "init_args": {"path": length, "factory_kwargs": None, "rename": {"x": "y"}}},
             {"class_path": "function", "init_args": {"path": length, "rename": {"x": "z"}}}]
    with caplog.at_level("INFO", logger="rlflow"):
        runner = JudgerRunner({"a": length, "b": twice}, reward_weights={"reward_len_3": 0.5})
    assert list(runner.judgers) == ["reward_len", "reward_len_2", "reward_len_3"]
    assert runner.routes == {"a": ["reward_len"], "b": ["reward_len_2", "reward_len_3"]}
    assert runner.weights == {"reward_len": 1.0, "reward_len_2": 1.0, "reward_len_3": 0.5}
    assert "a second judger named 'reward_len' is reward_len_2" in caplog.text
    named = JudgerRunner({"a": length, "b": {"class_path": "function", "init_args": {"path": length, "name": "len2"}}})
    assert sorted(named.judgers) == ["len2", "reward_len"]


def test_config_errors_are_specific():
    with pytest.raises(registry.PluginError, match="available: .*gsm8k"):
        JudgerRunner({"a": "gsm8kk"})
    with pytest.raises(ValueError, match="data.judging.weights names judger 'nope'"):
        JudgerRunner({"a": "gsm8k"}, reward_weights={"nope": 1.0})
    with pytest.raises(ValueError, match="data.judging.timeout must be positive"):
        JudgerRunner({"a": "gsm8k"}, timeout=0)
    with pytest.raises(ValueError, match="data.judging.judgers is empty"):
        JudgerRunner({})
    runner = JudgerRunner({"a": J1})
    with pytest.raises(KeyError, match=r"no judger for data_source 'zzz'.*\['a'\]"):
        runner.judge(["p"], ["c0"], [[1]], {"data_source": ["zzz"]})


# ----------------------------------------------------------------------------------------- concurrency
SPANS: dict[str, tuple[float, float]] = {}


async def slow_async_a(completions, **kwargs):
    start = time.perf_counter()
    await asyncio.sleep(0.5)
    SPANS["a"] = (start, time.perf_counter())
    return [1.0] * len(completions)


async def slow_async_b(completions, **kwargs):
    start = time.perf_counter()
    await asyncio.sleep(0.5)
    SPANS["b"] = (start, time.perf_counter())
    return [2.0] * len(completions)


def slow_sync(completions, **kwargs):
    start = time.perf_counter()
    time.sleep(0.5)
    SPANS["sync"] = (start, time.perf_counter())
    return [4.0] * len(completions)


def test_two_async_judgers_overlap_in_time():
    runner = JudgerRunner({"*": [slow_async_a, slow_async_b]})
    t0 = time.perf_counter()
    result = runner.judge(*batch(2))
    wall = time.perf_counter() - t0
    assert result.rewards == [3.0, 3.0]
    sleeps = sum(end - start for start, end in SPANS.values())
    assert sleeps >= 1.0 and wall < 0.8 * sleeps, (wall, sleeps)  # run one after the other, wall would be >= 1 s
    (a0, a1), (b0, b1) = SPANS["a"], SPANS["b"]
    assert max(a0, b0) < min(a1, b1)  # the two calls were in flight at the same time


def test_sync_judgers_run_beside_async_ones():
    SPANS.clear()
    runner = JudgerRunner({"*": [slow_async_a, slow_sync]}, isolation="thread")
    t0 = time.perf_counter()
    assert runner.judge(*batch(1)).rewards == [5.0]
    assert time.perf_counter() - t0 < 0.9
    assert max(SPANS["a"][0], SPANS["sync"][0]) < min(SPANS["a"][1], SPANS["sync"][1])


def test_judging_inside_a_running_event_loop():
    runner = JudgerRunner({"*": [slow_async_a]})

    async def caller():  # e.g. a notebook or an async server calling the trainer
        return runner.judge(*batch(2))

    assert asyncio.run(caller()).rewards == [1.0, 1.0]


def test_runner_pickles_and_judges_after_unpickling():
    runner = JudgerRunner({"*": [ok_judger, "gsm8k"]})
    runner.judge(["p"], ["#### 3"], [[1]], {"data_source": ["x"], "ground_truth": ["3"]})  # starts its loop thread
    clone = pickle.loads(pickle.dumps(runner))  # e.g. a datamodule sent to spawned processes
    assert clone.judge(["p"], ["#### 3"], [[1]], {"data_source": ["x"], "ground_truth": ["3"]}).rewards == [2.0]


# -------------------------------------------------------------------------------------------- failures
RELEASE = threading.Event()
CANCELLED = threading.Event()


def hung_sync(completions, **kwargs):
    RELEASE.wait(20)
    return [9.0] * len(completions)


async def hung_async(completions, **kwargs):
    try:
        await asyncio.sleep(20)
    except asyncio.CancelledError:
        CANCELLED.set()
        raise
    return [9.0] * len(completions)


def ok_judger(completions, **kwargs):
    return [1.0] * len(completions)


def raising_judger(completions, **kwargs):
    raise RuntimeError("the grader crashed")


def raises_timeout_itself(completions, **kwargs):
    raise TimeoutError("sandbox said: too slow")


@pytest.mark.parametrize("hung", [hung_sync, hung_async])
def test_a_hung_judger_times_out_and_the_others_still_count(hung, caplog):
    RELEASE.clear()
    runner = JudgerRunner({"a": [hung, ok_judger]}, timeout=0.3)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            t0 = time.perf_counter()
            result = runner.judge(*batch(3, sources=("a", "a", "a")))
            wall = time.perf_counter() - t0
    finally:
        RELEASE.set()
    assert wall < 3.0  # the hung call is abandoned after 0.3 s, not waited for (20 s)
    assert result.rewards == [1.0, 1.0, 1.0]
    assert result.per_judger[hung.__name__] == [None, None, None]
    assert result.metrics["judger/failures"] == 3.0
    assert result.failed == [(hung.__name__,)] * 3  # each sample marked (trajectories.jsonl's judgers_failed)
    messages = [r.getMessage() for r in caplog.records]
    assert [m for m in messages if hung.__name__ in m and "data.judging.timeout=0.3" in m]
    if hung is hung_async:
        assert CANCELLED.wait(2)  # the coroutine was cancelled, not left running


BLOCKED = threading.Event()


async def blocking_async(completions, **kwargs):
    """An ``async def`` judger that blocks its event loop (a synchronous wait inside a coroutine)."""
    BLOCKED.wait(20)
    return [9.0] * len(completions)


def test_an_async_judger_that_blocks_its_loop_times_out_batch_after_batch(caplog):
    BLOCKED.clear()
    runner = JudgerRunner({"a": [blocking_async, slow_async_a, ok_judger]}, timeout=1.0)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            t0 = time.perf_counter()
            first = runner.judge(*batch(2, sources=("a", "a")))
            second = runner.judge(*batch(2, sources=("a", "a")))
            wall = time.perf_counter() - t0
    finally:
        BLOCKED.set()
    assert wall < 6.0  # two batches, each abandoning the blocked call after 1 s (not 20 s)
    for result in (first, second):
        assert result.per_judger["blocking_async"] == [None, None]
        assert result.per_judger["slow_async_a"] == [1.0, 1.0]  # an async judger on its own loop still answers
        assert result.rewards == [2.0, 2.0] and result.metrics["judger/failures"] == 2.0
    assert [r for r in caplog.records if "'blocking_async'" in r.getMessage() and "new loop" in r.getMessage()]


def test_a_runner_whose_abandoned_loop_has_closed_is_collected_quietly(monkeypatch):
    """A blocked async judger's loop is abandoned; once the blocking call returns it stops and closes. Collecting
    the runner later runs its finalizers (stop every loop it made) on that closed loop too, without an error (an
    "Exception ignored ... Event loop is closed" traceback before)."""
    import gc
    import sys
    import weakref

    BLOCKED.clear()
    runner = JudgerRunner({"a": [blocking_async, ok_judger]}, timeout=0.5)
    try:
        runner.judge(*batch(1, sources=("a",)))  # times out; the call keeps blocking its loop
        abandoned = runner._judger_loops["blocking_async"]
        runner.judge(*batch(1, sources=("a",)))  # a new loop for the judger; the old one is told to stop
    finally:
        BLOCKED.set()  # the blocking calls return: the abandoned loop stops and closes
    deadline = time.monotonic() + 10
    while not abandoned.is_closed() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert abandoned.is_closed()
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    alive = weakref.ref(runner)
    del runner
    gc.collect()
    assert alive() is None  # the finalizers ran
    assert unraisable == [], [u.exc_value for u in unraisable]


def test_an_async_judger_keeps_its_event_loop_across_batches():
    seen = []

    async def loop_recorder(completions, **kwargs):
        seen.append(asyncio.get_running_loop())
        return [0.0] * len(completions)

    runner = JudgerRunner({"*": [loop_recorder]})
    runner.judge(*batch(1))
    runner.judge(*batch(1))
    assert len(seen) == 2 and seen[0] is seen[1]  # loop-bound clients (e.g. an HTTP session) survive
    assert seen[0] is not runner.loop()


def test_a_raising_judger_gives_none_is_counted_and_logged_once(caplog):
    runner = JudgerRunner({"*": [raising_judger, ok_judger, raises_timeout_itself]})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first = runner.judge(*batch(2))
        second = runner.judge(*batch(4))
    assert first.rewards == [1.0, 1.0] and second.rewards == [1.0] * 4
    assert first.metrics["judger/failures"] == 4.0 and second.metrics["judger/failures"] == 8.0
    assert second.failed == [("raising_judger", "raises_timeout_itself")] * 4  # ok_judger did not fail
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    crashed = [r for r in warnings if "'raising_judger'" in r.getMessage()]
    assert len(crashed) == 1 and "the grader crashed" in crashed[0].getMessage()
    assert crashed[0].exc_info and isinstance(crashed[0].exc_info[1], RuntimeError)  # the traceback is logged
    own = [r for r in warnings if "'raises_timeout_itself'" in r.getMessage()]
    assert len(own) == 1 and "too slow" in own[0].getMessage() and "data.judging.timeout" not in own[0].getMessage()


def infinite_for_odd_ids(completions, completion_ids, **kwargs):
    return [float("inf") if len(ids) % 2 else 0.5 for ids in completion_ids]


def test_infinite_rewards_count_as_failed_samples_and_the_others_keep_theirs(caplog):
    runner = JudgerRunner({"*": [infinite_for_odd_ids, ok_judger]})
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        result = runner.judge(*batch(4))  # completion ids of lengths 1, 2, 3, 4
    assert result.per_judger["infinite_for_odd_ids"] == [None, 0.5, None, 0.5]
    assert result.rewards == [1.0, 1.5, 1.0, 1.5] and all(math.isfinite(r) for r in result.rewards)
    assert result.metrics["judger/failures"] == 2.0
    assert result.failed == [("infinite_for_odd_ids",), (), ("infinite_for_odd_ids",), ()]
    assert [r for r in caplog.records if "'infinite_for_odd_ids'" in r.getMessage() and "inf" in r.getMessage()]


def wrong_count(completions, **kwargs):
    return [1.0]


def not_a_number(completions, **kwargs):
    return ["1.0"] * len(completions)


def booleans(completions, **kwargs):
    return [True, np.bool_(False), torch.tensor(0.25), np.float32(0.5), np.array(2.0)][: len(completions)]


def a_vector_per_sample(completions, **kwargs):
    return [torch.tensor([1.0, 2.0])] * len(completions)


def a_complex_tensor(completions, **kwargs):
    return [torch.tensor(1 + 2j)] * len(completions)


def a_string(completions, **kwargs):
    return "1.0"


def numpy_rewards(completions, **kwargs):
    return np.array([0.5] * len(completions), dtype=np.float32)


def test_contract_breaches_are_errors_naming_the_judger():
    with pytest.raises(ValueError, match="judger 'wrong_count' returned 1 rewards for 2 completions"):
        JudgerRunner({"*": [wrong_count]}).judge(*batch(2))
    with pytest.raises(TypeError, match="judger 'not_a_number' returned '1.0' \\(str\\)"):
        JudgerRunner({"*": [not_a_number]}).judge(*batch(2))
    # (in its worker process the tensor became a list: only plain values travel back)
    with pytest.raises(TypeError, match="judger 'a_vector_per_sample' returned \\[1.0, 2.0\\] \\(list\\)"):
        JudgerRunner({"*": [a_vector_per_sample]}).judge(*batch(2))
    with pytest.raises(TypeError, match="judger 'a_complex_tensor' returned"):
        JudgerRunner({"*": [a_complex_tensor]}).judge(*batch(2))
    with pytest.raises(TypeError, match="judger 'a_string' returned a str"):
        JudgerRunner({"*": [a_string]}).judge(*batch(2))
    # what TRL's torch.tensor(rewards, dtype=torch.float32) takes: booleans, numpy scalars, 0-d arrays and tensors
    assert JudgerRunner({"*": [booleans]}).judge(*batch(5)).rewards == [1.0, 0.0, 0.25, 0.5, 2.0]
    # numpy numbers are numbers
    assert JudgerRunner({"*": [numpy_rewards]}).judge(*batch(2)).rewards == [0.5, 0.5]


def mutates_its_arguments(prompts, completions, extra_info, **kwargs):
    for prompt, info in zip(prompts, extra_info):
        prompt[0]["content"] = "MUTATED"
        info["mutated"] = True
    completions.clear()
    return [1.0] * len(prompts)


async def mutates_asynchronously(prompts, completions, extra_info, **kwargs):
    return mutates_its_arguments(prompts, list(completions), extra_info)


SEEN = []


def observes(prompts, extra_info, **kwargs):
    SEEN.append(([p[0]["content"] for p in prompts], [dict(i) for i in extra_info]))
    return [0.0] * len(prompts)


@pytest.mark.parametrize("mutator", [mutates_its_arguments, mutates_asynchronously])
def test_a_judger_in_the_trainer_changes_neither_the_data_nor_what_others_see(mutator):
    prompts = [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    extra_info = [{"i": i} for i in range(3)]
    completions = [f"c{i}" for i in range(3)]
    runner = JudgerRunner({"*": [mutator, observes]}, isolation="thread")
    SEEN.clear()
    for _ in range(2):  # the second batch sees the data as it was
        result = runner.judge(prompts, completions, [[1]] * 3, {"extra_info": extra_info})
        assert result.rewards == [1.0] * 3
    assert SEEN == [([f"q{i}" for i in range(3)], extra_info)] * 2
    assert prompts == [[{"role": "user", "content": f"q{i}"}] for i in range(3)]
    assert extra_info == [{"i": i} for i in range(3)] and completions == ["c0", "c1", "c2"]
