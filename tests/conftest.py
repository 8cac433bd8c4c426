"""Shared fixtures: a tiny random Qwen3 model and tokenizer, and the synthetic arithmetic data, built once."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def load_tool(name: str):
    """Import ``tools/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class ProgressRecorder:
    """A rollout progress listener (``start``/``update``/``close``) that records its calls."""

    def __init__(self):
        self.calls = []

    def start(self, total):
        self.calls.append(("start", total))

    def update(self, completions, tokens):
        self.calls.append(("update", completions, tokens))

    def close(self):
        self.calls.append(("close",))


@pytest.fixture
def progress_recorder() -> ProgressRecorder:
    return ProgressRecorder()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A random-init tiny Qwen3 model + char tokenizer (no SFT: fast), and its arithmetic data beside it."""
    root = tmp_path_factory.mktemp("tiny")
    load_tool("make_tiny_model").build(root / "model", data_dir=root / "data", sft_steps=0, seed=0)
    return root / "model"


@pytest.fixture(scope="session")
def tiny_data(tiny_model) -> Path:
    """Directory with ``train.jsonl`` and ``val.jsonl`` of the synthetic arithmetic task (XTuner RL format)."""
    return tiny_model.parent / "data"


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def small_data(tiny_data, tmp_path_factory) -> Path:
    """8 training prompts (2 rollout steps of 4 per epoch) and 4 eval prompts."""
    out = tmp_path_factory.mktemp("small")
    rows = (tiny_data / "train.jsonl").read_text().splitlines()[:8]
    (out / "train.jsonl").write_text("\n".join(rows) + "\n")
    (out / "val.jsonl").write_text("\n".join((tiny_data / "val.jsonl").read_text().splitlines()[:4]) + "\n")
    return out


@pytest.fixture
def one_thread():
    """The tiny model runs faster on one thread than on two that share CPU cores with other processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fit_args(tiny_model: Path, tiny_data: Path, root: Path, *extra: str, steps: int = 3) -> list[str]:
    """Arguments of a small ``rlflow fit`` run on the tiny model, logging CSV under ``root``."""
    return [
        "fit",
        f"--model.model_path={tiny_model}",
        "--model.lr=1e-3",
        f"--data.train_data_path={tiny_data / 'train.jsonl'}",
        "--data.prompt_repeat_k=4",
        "--data.global_batch_size=4",
        "--data.max_tokens=12",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        f"--trainer.max_steps={steps}",
        f"--trainer.default_root_dir={root}",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
        f"--trainer.logger.save_dir={root}",
        "--trainer.enable_progress_bar=false",
        *extra,
    ]
