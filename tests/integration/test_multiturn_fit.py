"""End to end: ``rlflow fit`` with multi-turn rollouts (the example ``guess_number`` environment, a tool) on the
``hf`` and ``engine`` backends, and the exact continuation of a multi-turn run from its checkpoint."""

from __future__ import annotations

import json

import pytest

from rlflow.cli import cli_main
from tests.helpers.fit import fit_args
from tests.helpers.resume_helpers import assert_same_final_state, assert_same_run, metrics_by_step, run_args

pytestmark = pytest.mark.slow

# the tiny model is random: a digit ends its turn (a stop token, ~10% per token), so turns are short and guesses
MULTI = ["--data.multiturn.environment=guess_number", "--data.multiturn.max_turns=3", "--data.sampling.max_tokens=160",
         '--data.sampling.stop=["0","1","2","3","4","5","6","7","8","9"]']


@pytest.mark.parametrize("backend, extra", [
    ("hf", []),
    ("engine", ["--data.multiturn.tools=[calculator]"]),
])
def test_multiturn_fit(backend, extra, tiny_model, small_data, tmp_path, one_thread):
    root = tmp_path / backend
    args = fit_args(tiny_model, small_data, root, *MULTI, *extra, f"--data.rollout={backend}",
                    '--data.judging.judgers={"*": "env_reward"}', "--model.export_hf=false", steps=2)
    cli = cli_main(args)
    assert cli.trainer.global_step == 2
    rows = metrics_by_step(root)
    assert sorted(rows) == [0, 1]
    for row in rows.values():
        assert 1.0 < row["turns/mean"] <= 3.0  # the environment answered, the model took more turns
        assert row["turns/max"] <= 3.0
        assert row["completions/mean_length"] <= 160  # model tokens only, within the trajectory budget
        assert row["tools/call_frequency"] >= 0.0 and row["loss"] == row["loss"]
    lines = [json.loads(line) for line in next(root.glob("lightning_logs/version_*/trajectories.jsonl"))
             .read_text().splitlines()]
    assert len(lines) == 2 * 4 * 4
    multi = [t for t in lines if "is wrong: my number is" in t["completion"]]
    assert multi and all("<|im_start|>user" in t["completion"] for t in multi)  # the whole conversation
    assert all("Guess my number between -20 and 20" in t["prompt"] for t in lines)  # the environment's prompt


def test_multiturn_run_continues_exactly(tiny_model, small_data, tmp_path, one_thread):
    straight, chained = tmp_path / "straight", tmp_path / "chained"
    extra = [*MULTI, "--data.rollout=engine"]
    cli_main(run_args(tiny_model, small_data, straight, *extra, steps=3))
    for i, stop in enumerate((1, 3)):
        resume = ["--ckpt_path=last"] if i else []
        cli_main(run_args(tiny_model, small_data, chained, *extra, *resume, steps=stop))
    assert_same_run(straight, chained, 3)
    assert_same_final_state(straight, chained, 3)
    assert any(row["turns/mean"] > 1.0 for row in metrics_by_step(straight).values())


def test_the_example_environment_package_passes_its_own_tests():
    """``plugins/rlflow-env-example`` (installed by tools/setup_env.sh) with its own tests, as CI runs them."""
    import subprocess
    import sys

    from tests.helpers.paths import ROOT

    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(ROOT / "plugins" / "rlflow-env-example" / "tests")], capture_output=True, text=True,
                         timeout=300, cwd=ROOT / "plugins" / "rlflow-env-example")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "4 passed" in out.stdout


def test_the_shipped_tools_demo_config_runs(tmp_path, one_thread):
    """``configs/demo_tools_cpu.yaml`` as shipped, for one step, on an un-trained build of its model and data."""
    from rlflow.demo.tiny_tool_model import build
    from tests.helpers.paths import ROOT

    model = build(tmp_path / "model", tmp_path / "data", phases=(), n_train=16, n_val=4, eval_prompts=0)
    cli = cli_main(["fit", "--config", str(ROOT / "configs" / "demo_tools_cpu.yaml"), f"--model.model_path={model}",
                    f"--data.train_data_path={tmp_path / 'data' / 'train.jsonl'}",
                    f"--data.eval_data_path={tmp_path / 'data' / 'val.jsonl'}", "--trainer.max_steps=1",
                    f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}", "--trainer.enable_progress_bar=false",
                    "--model.export_hf=false", "--data.sampling.max_tokens=40"])
    assert cli.trainer.global_step == 1
    metrics = cli.trainer.callback_metrics
    assert "tools/call_frequency" in metrics and "turns/mean" in metrics
    assert cli.datamodule.multiturn is not None and list(cli.datamodule.tools) == ["calculator"]
