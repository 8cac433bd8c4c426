"""A TRL GRPO config as ``trl grpo --config`` reads it, converted by ``rlflow config from-trl``, trains: ``rlflow
fit --config`` on the converted file runs its steps on the tiny model, with TRL's reward functions (one by TRL's
script name, one by dotted import path, weighted) judging a dataset folder in TRL's layout."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

from rlflow.cli import cli_main
from rlflow.entry import main

pytest.importorskip("trl.rewards", reason="TRL is not installed (pip install --no-deps trl; it is in the dev extra)")

pytestmark = pytest.mark.slow


def trl_dataset_folder(tiny_data: Path, root: Path) -> Path:
    """A folder as ``datasets.load_dataset`` reads it (``train.jsonl``, ``test.jsonl``), rows in TRL's
    conversational layout: ``prompt`` messages and a ``solution``."""
    folder = root / "arith"
    folder.mkdir(parents=True)
    rows = [json.loads(line) for line in (tiny_data / "train.jsonl").read_text().splitlines()[:20]]
    trl_rows = [json.dumps({"prompt": r["prompt"], "solution": r["reward_model"]["ground_truth"]}) for r in rows]
    (folder / "train.jsonl").write_text("\n".join(trl_rows[:16]) + "\n")
    (folder / "test.jsonl").write_text("\n".join(trl_rows[16:]) + "\n")
    return folder


def test_a_converted_trl_config_trains(tiny_model, tiny_data, tmp_path, capsys):
    trl_config = tmp_path / "grpo_config.yaml"
    trl_config.write_text(yaml.safe_dump({
        "model_name_or_path": str(tiny_model),
        "dataset_name": str(trl_dataset_folder(tiny_data, tmp_path)),
        "reward_funcs": ["think_format_reward", "tests.helpers.trl_rewards.soft_overlong"],
        "reward_weights": [1.0, 0.5],
        "num_generations": 4,
        "per_device_train_batch_size": 16,  # 16 completions: 4 prompts a step
        "max_completion_length": 12,
        "learning_rate": "1e-3",
        "max_steps": 2,
        "seed": 0,
        "use_cpu": True,
        "bf16": False,
        "gradient_checkpointing": False,
        "logging_steps": 1,
        "save_strategy": "no",
        "output_dir": str(tmp_path / "out"),
    }))
    assert main(["config", "from-trl", str(trl_config)]) == 0
    converted = tmp_path / "rlflow.yaml"
    converted.write_text(capsys.readouterr().out)
    config = yaml.safe_load(converted.read_text())
    assert config["data"]["train_data_path"] == str(tmp_path / "arith" / "train.jsonl")
    assert (config["data"]["global_batch_size"], config["data"]["prompt_repeat_k"]) == (4, 4)
    assert config["model"]["loss"]["class_path"] == "dapo" and config["trainer"]["max_steps"] == 2

    cli = cli_main(["fit", "--config", str(converted), "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
                    f"--trainer.logger.save_dir={tmp_path / 'logs'}", "--trainer.enable_progress_bar=false"])
    assert cli.trainer.global_step == 2
    log_dir = Path(cli.trainer.log_dir)
    assert log_dir.is_relative_to(tmp_path)
    with open(log_dir / "metrics.csv") as f:
        metrics = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    assert len(metrics) == 2
    for step in metrics:
        think, overlong = step["rewards/think_format_reward/mean"], step["rewards/soft_overlong/mean"]
        assert step["reward"] == pytest.approx(1.0 * think + 0.5 * overlong)  # reward_weights, by judger name
    assert any(step["rewards/soft_overlong/mean"] < 0 for step in metrics)  # completions past 8 tokens penalised
    assert not (log_dir / "checkpoints").exists()  # save_strategy: no
