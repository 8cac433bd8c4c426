"""One step unit: with 4 optimizer steps per rollout step, every step count a user sets counts rollout steps.

``trainer.max_steps``, ``samples.every_n_steps``, ``checkpoint.every_n_train_steps``, ``--evaluate_every_n_steps``,
``trainer.log_every_n_steps`` and the ``step`` of metrics.csv and trajectories.jsonl (see
``rlflow.training.step_unit``);
the learning-rate schedule counts optimizer steps and spans the run's ``max_steps x optimizer_steps``.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import WandbLogger

from rlflow.cli import cli_main
from tests.helpers.resume_helpers import metrics_by_step, run_args

pytestmark = pytest.mark.slow


class TableRecorder(WandbLogger):
    """A ``WandbLogger`` that records the steps of its tables and starts no W&B run (one left running would be
    reused by the next ``WandbLogger`` of the session, test_wandb's)."""

    def __init__(self, save_dir: str) -> None:
        super().__init__(offline=True, save_dir=save_dir)
        self.table_steps: list[int] = []
        self.eval_table_steps: list[int] = []

    @property
    def experiment(self) -> None:  # Lightning's setup reads it, which would start the run
        return None

    def log_table(self, key, columns=None, data=None, dataframe=None, step=None) -> None:
        (self.table_steps if key == "samples" else self.eval_table_steps).append(step)

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        pass

    def after_save_checkpoint(self, checkpoint_callback) -> None:
        pass

    def finalize(self, status) -> None:
        pass


class EvalSteps(L.Callback):
    """Records ``trainer.global_step`` at every evaluation."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_validation_end(self, trainer, pl_module) -> None:
        self.steps.append(trainer.global_step)


def test_every_step_count_is_in_rollout_steps(tiny_model, small_data, tmp_path, one_thread):
    save_dir = {"save_dir": str(tmp_path)}
    loggers = json.dumps([{"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": save_dir},
                          {"class_path": "tests.integration.test_step_unit.TableRecorder", "init_args": save_dir}])
    args = [a for a in run_args(tiny_model, small_data, tmp_path, steps=21) if not a.startswith("--trainer.logger")]
    cli = cli_main(
        [
            *args,
            f"--trainer.logger={loggers}",
            "--trainer.callbacks+=tests.integration.test_step_unit.EvalSteps",
            "--model.update.optimizer_steps=4",
            "--data.global_batch_size=2",
            "--data.prompt_repeat_k=2",
            "--data.sampling.max_tokens=4",
            "--samples.every_n_steps=10",
            "--checkpoint.every_n_train_steps=10",
            "--checkpoint.save_top_k=-1",
            f"--data.eval_data_path={small_data / 'val.jsonl'}",
            "--data.eval.batch_size=4",
            "--evaluate_every_n_steps=10",
            "--trainer.log_every_n_steps=5",
            "--model.optim.lr_schedule=linear",
        ]
    )
    trainer = cli.trainer
    assert trainer.global_step == 21 and cli.model.policy_version == 84  # 21 rollout steps x 4 optimizer steps
    # the table of rollout steps 1, 11 and 21; W&B's step is the 0-based index metrics.csv and trajectories use
    assert trainer.loggers[1].table_steps == [0, 10, 20]
    evals = next(c for c in trainer.callbacks if isinstance(c, EvalSteps))
    assert evals.steps == [10, 20]
    ckpt_dir = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    assert sorted(torch.load(p, weights_only=True)["global_step"] for p in ckpt_dir.glob("epoch=*.ckpt")) == [10, 20]
    assert sorted(p.name.split("step=")[1] for p in ckpt_dir.glob("epoch=*.ckpt")) == ["10.ckpt", "20.ckpt"]
    assert torch.load(ckpt_dir / "last.ckpt", weights_only=True)["global_step"] == 21
    logged = metrics_by_step(tmp_path)
    assert sorted(logged) == [4, 9, 14, 19]  # log_every_n_steps=5, 0-based rollout steps
    # linear decay over 21 x 4 = 84 optimizer steps: after rollout step s, 4 (s + 1) of them; 0 at the run's end
    for step, row in logged.items():
        assert row["lr"] == pytest.approx(1e-3 * (1 - 4 * (step + 1) / 84), rel=1e-5), step
    assert trainer.optimizers[0].param_groups[0]["lr"] == 0.0
    assert sorted(metrics_by_step(tmp_path, "eval/accuracy")) == [9, 19]  # logged with the step just finished
    assert trainer.loggers[1].eval_table_steps == [9, 19]  # the eval_samples tables beside those metrics
    rows = (tmp_path / "lightning_logs" / "version_0" / "trajectories.jsonl").read_text().splitlines()
    assert sorted({json.loads(row)["step"] for row in rows}) == list(range(21))


@pytest.mark.parametrize("recipe", ["grpo_gsm8k_qwen3_8b.yaml", "grpo_gsm8k_qwen3_8b_lmdeploy.yaml"])
def test_seed_recipes_evaluate_every_10_rollout_steps_as_xtuner(recipe):
    """XTuner's GSM8K recipe evaluates every 10 rollout steps of 4 optimizer steps; the unit is the rollout step,
    so the recipe says 10 (it said 40, which evaluated every 40 rollout steps)."""
    import yaml

    from tests.helpers.paths import ROOT

    config = yaml.safe_load((ROOT / "configs" / recipe).read_text())
    assert config["model"]["update"]["optimizer_steps"] == 4
    assert config["trainer"]["val_check_interval"] == 10 and config["trainer"]["check_val_every_n_epoch"] is None
