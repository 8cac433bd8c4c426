"""Monitoring without a run: the logger short names, the sample tables' rows, and the rollout progress listener (W&B,
TensorBoard, the progress bar and the step summary in ``rlflow fit``: ``tests/integration/test_wandb_fit.py``)."""


from __future__ import annotations

import pytest

from rlflow.cli import expand_logger_aliases
from rlflow.training.callbacks import table_samples

pytestmark = pytest.mark.slow


def test_logger_short_names_expand():
    assert expand_logger_aliases(["fit", "--trainer.logger", "wandb", "--trainer.logger=CSV", "-c", "x.yaml",
                                  "--trainer.logger", "tensorboard", "--trainer.logger.save_dir", "tb"]) == [
        "fit", "--trainer.logger=lightning.pytorch.loggers.WandbLogger",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir=.", "-c", "x.yaml",
        "--trainer.logger=lightning.pytorch.loggers.TensorBoardLogger", "--trainer.logger.save_dir=.",
        "--trainer.logger.save_dir", "tb"]
    assert expand_logger_aliases(["--trainer.logger=MyLogger"]) == ["--trainer.logger=MyLogger"]


def test_sample_table_rows_by_hand():
    """The first ``num_samples`` samples; with ``unique_prompts``, each prompt's first completion (a prompt repeated
    under another data source is another prompt)."""
    samples = [{"prompt": p, "data_source": d, "completion": c} for p, d, c in [
        ("a", "x", 0), ("a", "x", 1), ([{"role": "user", "content": "b"}], "x", 2), ("a", "x", 3),
        ([{"role": "user", "content": "b"}], "x", 4), ("a", "y", 5), ("c", "x", 6)]]
    assert [s["completion"] for s in table_samples(samples, 3)] == [0, 1, 2]
    assert [s["completion"] for s in table_samples(samples, 3, unique_prompts=True)] == [0, 2, 5]
    assert [s["completion"] for s in table_samples(samples, 10, unique_prompts=True)] == [0, 2, 5, 6]


def test_progress_listener_counts_per_batch_when_the_backend_reports(progress_recorder):
    from rlflow.judgers.overlap import generate_and_judge
    from rlflow.judgers.runner import JudgeResult
    from rlflow.rollout.base import Completion, RolloutBackend, SamplingParams

    class Reporting(RolloutBackend):
        def generate(self, prompts, params, n=1, progress=None):
            out = []
            for _ in prompts:  # one "batch" per prompt
                group = [Completion([1, 2, 3], [0.0] * 3, "stop") for _ in range(n)]
                out.append(group)
                progress(n, 3 * n)
            return out

    def judge(records, completions, k):
        return JudgeResult([0.0] * len(completions)), [""] * len(completions)

    records = [type("Record", (), {"prompt_ids": ids})() for ids in ([1], [2])]
    groups = generate_and_judge(Reporting(), judge, records, SamplingParams(), 4, listener=progress_recorder)[0]
    assert len(groups) == 2 and progress_recorder.calls == [
        ("start", 8), ("update", 4, 12), ("update", 4, 12), ("close",)]

