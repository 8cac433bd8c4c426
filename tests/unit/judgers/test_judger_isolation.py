"""User-written judgers in worker processes (``data.judging.isolation: process``, the default): a hung one is killed
with what it started and replaced, one that exits, crashes or returns what cannot travel fails its call, and what a
judger gets and logs (``trainer_state``, ``log_extra``, ``log_metric``, ``consume_failed``) is the same as in a
thread. The hostile judgers are in :mod:`tests.helpers.hostile`."""

from __future__ import annotations

import logging
import os
import threading
import time

import pytest

from rlflow.judgers.context import RunState
from rlflow.judgers.function import FunctionJudger
from rlflow.judgers.gsm8k import GSM8KJudger
from rlflow.judgers.runner import JudgerRunner, runs_in_worker
from tests.helpers import hostile

H = "tests.helpers.hostile"


def batch(texts, pidfile="unused", **columns):
    n = len(texts)
    return ([f"p{i}" for i in range(n)], list(texts), [[0] * (i + 1) for i in range(n)],
            {"pidfile": [str(pidfile)] * n, **columns})


def test_a_hung_judger_is_killed_at_the_timeout_and_the_next_batch_gets_a_fresh_worker(tmp_path):
    pidfile = tmp_path / "pids"
    runner = JudgerRunner({"*": [hostile.hangs_on_request, hostile.pid_reward]}, timeout=1.0)
    assert runner.judge(*batch(["fine"], pidfile)).per_judger["hangs_on_request"] == [1.0]
    threads = threading.active_count()
    t0 = time.monotonic()
    hung = runner.judge(*batch(["hang", "fine"], pidfile))
    assert time.monotonic() - t0 < 3.0
    stats = hung.judgers["hangs_on_request"]
    assert (stats.failed, stats.killed) == (2, 1) and stats.error.startswith("JudgerTimeout: judger 'hangs_on_request' "
                                                                            "did not answer within")
    assert "its worker process was killed" in stats.error
    assert hung.metrics["judger/killed_workers"] == 1.0 and hung.metrics["judger/abandoned_threads"] == 0.0
    worker = float(hung.per_judger["pid_reward"][0])  # the other judger scored in its own worker meanwhile
    assert worker != os.getpid() and hung.per_judger["pid_reward"] == [worker, worker]
    first, killed = hostile.read_pids(pidfile)
    assert first == killed and hostile.all_gone([killed])
    again = runner.judge(*batch(["fine"], pidfile))
    assert again.per_judger["hangs_on_request"] == [1.0] and again.metrics["judger/killed_workers"] == 0.0
    assert hostile.read_pids(pidfile)[-1] != killed  # a fresh worker
    assert hostile.threads_at_most(threads), threading.enumerate()  # nothing was left running here


def test_the_processes_a_hung_judger_started_die_with_it(tmp_path):
    pidfile = tmp_path / "pids"
    result = JudgerRunner({"*": hostile.hangs_with_a_grandchild}, timeout=1.0).judge(*batch(["a"], pidfile))
    assert result.judgers["hangs_with_a_grandchild"].killed == 1
    worker, grandchild = hostile.read_pids(pidfile)
    assert hostile.all_gone([worker, grandchild])


@pytest.mark.parametrize("judger, error", [
    (hostile.exits, "SystemExit: 3"),
    (hostile.interrupted, "KeyboardInterrupt"),
    (hostile.exits_hard, "WorkerCrashed: the worker process of judger 'exits_hard' exited with code 7 during the call"),
    (hostile.segfaults, "WorkerCrashed: the worker process of judger 'segfaults' was killed by signal SIGSEGV during"),
    (hostile.returns_a_lambda, "TypeError: it returned [<function returns_a_lambda.<locals>."),
    (hostile.raises_unpicklable, "WorkerError: NeedsTwoArguments: left and right (its exception could not be sent"),
    (hostile.ExitsWhenLoaded(), "WorkerCrashed: judger 'ExitsWhenLoaded' cannot be loaded in a worker process: "
                                "SystemExit: 5"),
])
def test_a_judger_that_exits_crashes_or_returns_what_cannot_travel_fails_its_calls_and_the_rest_goes_on(judger, error):
    runner = JudgerRunner({"*": [judger, hostile.pid_reward]}, timeout=20)
    name = getattr(judger, "__name__", type(judger).__name__)
    for _ in range(2):  # the next call meets the same fate, not a hang; the other judger scores every time
        result = runner.judge(*batch(["a", "b"]))
        assert result.judgers[name].failed == 2 and result.judgers[name].error.startswith(error)
        assert result.judgers["pid_reward"].failed == 0 and result.rewards[0] != os.getpid()


def test_trainer_state_and_logs_reach_and_come_back_from_the_worker_as_from_a_thread():
    state = RunState(global_step=3, max_steps=5)
    process, thread = (JudgerRunner({"*": hostile.logs_in_the_trainer_state}, isolation=isolation).judge(
        *batch(["abc", "defg"]), state=state) for isolation in ("process", "thread"))
    assert process.rewards == thread.rewards == [3.0, 3.0]
    assert process.extra == thread.extra == {"step_seen": [3, 3], "text": ["abc", "def"]}
    assert process.logged == thread.logged == {"steps_left": [2.0]}
    process, thread = (JudgerRunner({"*": hostile.logs_too_few}, isolation=isolation).judge(*batch(["a", "b"]))
                       for isolation in ("process", "thread"))
    error = process.judgers["logs_too_few"].error
    assert error == thread.judgers["logs_too_few"].error
    assert "log_extra('short', values) got 1 values for the call's 2 completions" in error


def test_per_sample_failures_a_judger_reports_in_its_worker_are_counted_here():
    judger = hostile.FailsOnOdd()
    result = JudgerRunner({"*": judger}).judge(*batch(["a", "b", "c", "d"]))
    assert result.judgers["FailsOnOdd"].failed == 2
    assert result.failed == [(), ("FailsOnOdd",), (), ("FailsOnOdd",)]
    assert judger.failed == []  # the trainer's copy was never called


def test_which_judgers_run_in_workers():
    assert runs_in_worker(hostile.pid_reward)
    assert runs_in_worker(FunctionJudger(f"{H}:pid_reward"))
    assert runs_in_worker(hostile.FailsOnOdd())
    assert not runs_in_worker(GSM8KJudger())  # rlflow's own
    assert not runs_in_worker(FunctionJudger("tests.helpers.reward_helpers:async_reward_one"))
    assert not runs_in_worker(hostile.takes_environments)
    runner = JudgerRunner({"*": [hostile.pid_reward, hostile.takes_environments]})
    [elsewhere], [here] = runner.judge(*batch(["a"])).per_judger.values()
    assert elsewhere != os.getpid() and here == os.getpid()
    # a call given the environment instances runs here, even for a judger taking **kwargs
    assert runner.judge(*batch(["a"], environments=[object()])).per_judger["pid_reward"] == [os.getpid()]
    threaded = JudgerRunner({"*": hostile.pid_reward}, isolation="thread")
    assert threaded.judge(*batch(["a"])).rewards == [os.getpid()]
    with pytest.raises(ValueError, match="data.judging.isolation must be one of process, thread, got 'fork'"):
        JudgerRunner({"*": hostile.pid_reward}, isolation="fork")


def test_a_factory_made_closure_loads_in_a_worker_by_its_import_path():
    judger = {"class_path": "function", "init_args": {"path": "tests.helpers.reward_helpers:make_reward_contains",
                                                      "factory_kwargs": {"char": "b"}}}
    runner = JudgerRunner({"*": judger})
    assert runner.judge(*batch(["a", "b"])).rewards == [0.0, 1.0]
    assert runner.pool("reward_contains").payload is not None  # rebuilt from its arguments, not forked


def test_a_closure_runs_in_a_thread_of_the_trainer_with_one_warning(caplog):
    here, calls = os.getpid(), []

    def closure(completions, **kwargs):
        calls.append(len(completions))  # state of the trainer, as its author meant
        return [float(os.getpid() == here)] * len(completions)

    runner = JudgerRunner({"*": closure}, timeout=1.0)
    with caplog.at_level(logging.WARNING, logger="rlflow.judgers.runner"):
        assert runner.judge(*batch(["a"])).rewards == [1.0]
        assert runner.judge(*batch(["b", "c"])).rewards == [1.0, 1.0]
    assert calls == [1, 2]
    warnings = [r.getMessage() for r in caplog.records if "runs in a thread of the trainer" in r.getMessage()]
    assert len(warnings) == 1 and "a worker process cannot load it" in warnings[0]


def test_the_settings_reach_the_judgers_and_the_tools():
    from rlflow.config_error import ConfigError
    from rlflow.data.datamodule import RolloutDataModule
    from rlflow.data.settings import JudgingSettings, MultiTurnSettings
    from rlflow.rollout.multiturn import MultiTurn
    from tests.helpers.paths import DATA

    with pytest.raises(ConfigError, match=r"^data\.judging\.isolation must be one of process, thread, got 'fork'"):
        JudgingSettings(isolation="fork")
    with pytest.raises(ConfigError, match=r"^data\.multiturn\.tool_isolation must be one of process, thread"):
        MultiTurnSettings(tool_isolation="fork")
    dm = RolloutDataModule(train_data_path=str(DATA / "train_example.jsonl"),
                           judging={"judgers": {"*": f"{H}:pid_reward"}, "isolation": "thread"},
                           multiturn={"tools": [f"{H}:pid_tool"], "tool_isolation": "thread"})
    assert dm.judges.default.isolation == "thread" and dm.judges.default.pool("pid_reward") is None
    assert MultiTurn(None, dm.tools, **dm.multiturn_args).runner.isolation == "thread"
