"""End to end: ``rlflow fit`` with TRL's ``environment_factory`` (a TRL-style environment class whose ``calculator``
method is the tool) on the tiny tool model, judged by a reward function that reads ``environments`` and by the
``env_reward`` judger over the class's ``get_reward``."""

from __future__ import annotations

import json

import pytest

from rlflow.cli import cli_main
from tests.helpers.fit import fit_args
from tests.helpers.resume_helpers import metrics_by_step
from tests.helpers.trl_envs import build_tool_caller

pytestmark = pytest.mark.slow


def test_fit_with_a_trl_environment_class_rewards_its_state(tmp_path, one_thread):
    model = build_tool_caller(tmp_path / "model", tmp_path)  # calls the calculator on most prompts
    root = tmp_path / "run"
    args = fit_args(model, tmp_path, root, "--data.multiturn.environment_factory=tests.helpers.trl_envs:CalculatorEnv",
                    "--data.multiturn.max_turns=2", "--data.sampling.max_tokens=160", "--data.rollout=engine",
                    '--data.judging.judgers={"*": ["tests.helpers.trl_envs:tool_calls_reward", "env_reward"]}',
                    "--model.optim.lr=1e-6", "--model.export_hf=false", steps=2)  # both steps call tools
    cli = cli_main(args)
    assert cli.trainer.global_step == 2
    assert "calculator" in cli.datamodule.train_records[0].prompt_text  # the method's schema reached the prompt
    rows = [json.loads(line) for line in next(root.glob("lightning_logs/version_*/trajectories.jsonl"))
            .read_text().splitlines()]
    assert len(rows) == 2 * 4 * 4
    for row in rows:
        calls, text = row["env_calls"], row["completion"]  # the instance's counter, reset for each rollout
        assert calls == len(row["env_expressions"])
        assert all(f'"expression": "{e}"' in text for e in row["env_expressions"])  # this completion's calls
        # between the tool results the trajectory read and the calls it wrote (a result past the budget is not read)
        assert text.count("<|im_start|>tool\n") <= calls <= text.count("<tool_call>")
        assert row["env_ground_truth"] == row["ground_truth"]  # reset got this row: environments in completion order
        assert row["reward"] == pytest.approx(calls + (1.0 if calls else 0.0))  # the counter + get_reward
    assert sum(row["env_calls"] for row in rows) > 0
    for step, metrics in metrics_by_step(root).items():
        step_rows = [row for row in rows if row["step"] == step]
        reached = metrics["tools/call_frequency"] * 16 - sum(metrics.get(f"tools/failures/{kind}", 0.0)
                                                             for kind in ("bad_arguments", "unknown_tool"))
        assert sum(r["env_calls"] for r in step_rows) == pytest.approx(reached)  # every call that reached a method
        assert metrics["rewards/env_reward/mean"] == pytest.approx(sum(r["env_calls"] > 0 for r in step_rows) / 16)
    assert len(cli.datamodule.multiturn.factory.pool) == 16  # one instance per trajectory, reused by the next step
