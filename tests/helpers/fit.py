"""The arguments of a small ``rlflow fit`` run on the tiny model (the ``tiny_model``/``tiny_data`` fixtures)."""

from __future__ import annotations

from pathlib import Path


def fit_args(tiny_model: Path, tiny_data: Path, root: Path, *extra: str, steps: int = 3) -> list[str]:
    """Arguments of a small ``rlflow fit`` run on the tiny model, logging CSV under ``root``."""
    return [
        "fit",
        f"--model.model_path={tiny_model}",
        "--model.optim.lr=1e-3",
        f"--data.train_data_path={tiny_data / 'train.jsonl'}",
        "--data.prompt_repeat_k=4",
        "--data.global_batch_size=4",
        "--data.sampling.max_tokens=12",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        f"--trainer.max_steps={steps}",
        f"--trainer.default_root_dir={root}",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.save_dir={root}",
        "--trainer.enable_progress_bar=false",
        *extra,
    ]
