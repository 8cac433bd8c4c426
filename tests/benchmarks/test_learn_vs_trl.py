"""benchmarks/learn_vs_trl.py: the summary's arithmetic (moving average, seconds to a reward) against values worked
out by hand."""

from __future__ import annotations

import pytest

from benchmarks import learn_vs_trl as bench


def test_moving_average_by_hand():
    assert bench.moving_average([0.0, 0.3, 0.6, 0.3]) == pytest.approx([0.0, 0.15, 0.3, 0.4])


def test_seconds_to_a_reward_count_every_step_up_to_the_first_that_reaches_it():
    rewards = [0.0, 0.3, 0.6, 0.3]  # moving averages 0, 0.15, 0.3, 0.4
    times = [10.0, 11.0, 12.0, 13.0]
    assert bench.seconds_to(0.3, rewards, times) == pytest.approx(33.0)
    assert bench.seconds_to(0.35, rewards, times) == pytest.approx(46.0)
    assert bench.seconds_to(0.5, rewards, times) is None
    assert [bench.steps_to(t, rewards) for t in (0.0, 0.15, 0.3, 0.35, 0.5)] == [1, 2, 3, 4, None]


def test_summary_line_states_the_first_and_last_rewards_accuracy_range_and_times():
    runs = [{"reward": [0.1] * 5 + [0.5] * 5, "step_time": [2.0] * 10, "accuracy": 0.75},
            {"reward": [0.0] * 10, "step_time": [4.0] * 10, "accuracy": 0.5}]
    line, reached = bench.summary("rlflow", runs, target=0.3)
    assert "reward steps 1-5 0.050 -> last 5 0.250" in line
    assert "held-out accuracy 62.5% (50.0%-75.0%)" in line and "median step 3.0 s" in line
    assert reached == [14.0, None]  # run 1: averages 0.1, 0.1, 0.1, 0.1, 0.1, 0.233, 0.367 -> 7 steps x 2 s
    assert line.endswith("seconds to reward 0.3: 14, never (steps 7, never)")


def test_a_wider_window_smooths_before_the_target_is_timed():
    rewards = [0.0, 0.6, 0.0, 0.3, 0.3, 0.3]  # 3-step averages 0, 0.3, ...; 5-step: 0, 0.3, 0.2, 0.225, 0.24, 0.3
    times = [1.0] * 6
    assert bench.seconds_to(0.3, rewards, times, window=3) == pytest.approx(2.0)
    assert bench.seconds_to(0.3, rewards, times, window=5) == pytest.approx(2.0)
    assert bench.seconds_to(0.25, rewards, times, window=5) == pytest.approx(2.0)
    assert bench.seconds_to(0.3, [0.0, 0.3, 0.3, 0.3, 0.3, 0.6], times, window=5) == pytest.approx(6.0)


def test_the_median_counts_a_run_that_never_reached_the_target_as_the_slowest():
    assert bench.median_seconds([30.0, None, 66.0]) == pytest.approx(66.0)
    assert bench.median_seconds([10.0, 20.0, 30.0, None, None]) == pytest.approx(30.0)
    assert bench.median_seconds([10.0, None, None]) == float("inf")
