"""Shared fixtures: a tiny random Qwen3 model and tokenizer, and the synthetic arithmetic data, built once.

The tests are laid out as the package is: ``unit/<package>/`` for rlflow's subpackages (``unit/`` itself for its
top-level modules, ``unit/demo/`` for the demo builders), ``integration/`` for runs of ``rlflow fit`` (in this
process or another), ``benchmarks/`` for the scripts in ``benchmarks/``, and ``helpers/`` for what they share
(``tests.helpers``).
"""

from __future__ import annotations

import os
import signal
import warnings
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(autouse=True)
def restored_environment(request):
    """Each test leaves ``os.environ``, torch's thread count, the default process group, whether finished runs
    keep their generator workers, and the SIGINT/SIGTERM handlers as it found them. An
    in-process run under a distributed strategy has Lightning export its rank and rendezvous address (``LOCAL_RANK``,
    ``MASTER_PORT``, ...); a later ``rlflow fit`` subprocess of the same worker would inherit them and wait for ranks
    nobody starts. A KeyboardInterrupt inside an in-process ``Trainer.fit`` has Lightning ignore SIGINT from then on:
    a later test's Ctrl-C (and a subprocess started after it, which inherits an ignored signal) would do nothing. A
    test that changed a handler is named in a warning, and the handler put back."""
    from rlflow.rollout import prestart

    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    environ = dict(os.environ)
    threads = torch.get_num_threads()
    keep_workers = prestart.KEEP_WORKERS  # the console script's entry point turns it off (tests call it in-process)
    yield
    prestart.KEEP_WORKERS = keep_workers
    if torch.get_num_threads() != threads:  # a run that shared out this process's threads (split rollouts)
        torch.set_num_threads(threads)
    if torch.distributed.is_available() and torch.distributed.is_initialized():  # an in-process run's group
        torch.distributed.destroy_process_group()
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    for number, handler in handlers.items():
        now = signal.getsignal(number)
        if now is not handler and handler is not None:
            signal.signal(number, handler)
            warnings.warn(f"{request.node.nodeid} left {signal.Signals(number).name}'s handler {now!r} "
                          f"(was {handler!r}); put back", stacklevel=1)


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
    from rlflow.demo.tiny_model import build

    root = tmp_path_factory.mktemp("tiny")
    build(root / "model", data_dir=root / "data", sft_steps=0, seed=0)
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



def pytest_collection_modifyitems(config, items):
    """Modules with end-to-end runs (``slow``) first, each module's tests kept together and in order: pytest-xdist
    hands tests out in this order, so the long runs start early and short tests fill the last minutes of every
    worker instead of one long run finishing alone."""
    slow_modules = {item.module.__name__ for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.module.__name__ not in slow_modules)
