"""The run-watching callbacks of :mod:`rlflow.training.callbacks` not covered elsewhere: :class:`NoSignalWarning`, and
the samples tables' columns.

What is checked: the warning's streak logic by hand (it fires once when ``patience`` steps in a row had no group with
differing rewards, re-arms after a step with signal, never fires with patience 0 or without the metric). Through
``rlflow fit``: ``tests/integration/test_callbacks_fit.py``.
"""


from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from rlflow.training.callbacks import EVAL_SAMPLE_COLUMNS, SAMPLE_COLUMNS, NoSignalWarning, table_columns


def run(callback: NoSignalWarning, fractions: list[float | None], caplog) -> list[int]:
    """Feed one ``frac_reward_zero_std`` per step (None: the metric absent); the steps (1-based) that warned."""
    warned = []
    for step, frac in enumerate(fractions, 1):
        metrics = {} if frac is None else {"frac_reward_zero_std": frac, "reward": 0.0}
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="rlflow"):
            callback.on_train_batch_end(None, SimpleNamespace(last_metrics=metrics), None, None, step - 1)
        if any("no learning signal" in r.getMessage() for r in caplog.records):
            warned.append(step)
    return warned


def test_the_streak_by_hand(caplog):
    assert run(NoSignalWarning(patience=2), [1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0], caplog) == [2, 6]
    assert run(NoSignalWarning(patience=3), [1.0, 1.0, 0.75, 1.0, 1.0, None, 1.0], caplog) == [7]  # None: no step
    assert run(NoSignalWarning(patience=1), [0.0, 1.0, 1.0, 0.25, 1.0], caplog) == [2, 5]
    assert run(NoSignalWarning(patience=0), [1.0] * 4, caplog) == []
    with pytest.raises(ValueError, match="no_signal.patience must be >= 0"):
        NoSignalWarning(patience=-1)


def constant_reward(completions, **kwargs):
    return [0.0] * len(completions)


def text_reward(completions, **kwargs):
    """A reward that differs between different completions (the tiny model's samples differ)."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(sum(map(ord, t)) % 97) for t in texts]



def test_tables_add_the_columns_judgers_logged_after_the_built_in_ones():
    row = {"step": 0, "rank": 0, "group": 0, "policy_version": 0, "reward": 1.0, "solution": "2", "gold_parsed": "[2]"}
    later = {**row, "answer_parsed": "[2]"}
    assert table_columns(SAMPLE_COLUMNS, [row, later]) == [*SAMPLE_COLUMNS, "solution", "gold_parsed", "answer_parsed"]
    assert table_columns(EVAL_SAMPLE_COLUMNS, [{"trained_steps": 0, "rank": 0, "batch": 1}]) == EVAL_SAMPLE_COLUMNS


def test_train_accuracy_counts_every_ranks_samples():
    """Under data parallelism each rank holds its share of the step's samples: ``train/accuracy`` is over all of
    them (here the other rank passed 1 of its 4), not rank zero's share alone."""
    import torch

    from rlflow.training.callbacks import StepSummary

    other_rank = torch.tensor([1.0, 4.0], dtype=torch.float64)
    logged = {}
    strategy = SimpleNamespace(reduce=lambda t, reduce_op: t + other_rank if reduce_op == "sum" else None)
    trainer = SimpleNamespace(strategy=strategy, datamodule=SimpleNamespace(eval_pass_threshold=1.0),
                              is_global_zero=True)
    samples = [{"reward": r} for r in (1.0, 1.0, 0.0, 0.5)]
    module = SimpleNamespace(last_metrics={}, last_rollout=SimpleNamespace(samples=samples), device=torch.device("cpu"),
                             log=lambda name, value, **kw: logged.update({name: (value, kw["batch_size"])}))
    StepSummary(enabled=False).on_train_batch_end(trainer, module, None, None, 0)
    assert logged["train/accuracy"] == (3 / 8, 8)


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "cuda"])
def test_the_step_line_shows_the_gpu_peak_where_one_was_measured(gpu, capsys):
    import torch

    from rlflow.training.callbacks import StepSummary

    metrics = {"reward": 0.5, "loss": 0.25, "step_time": 2.0, "memory/max_rss_gb": 3.0,
               **({"memory/max_allocated_gb": 12.34} if gpu else {})}
    trainer = SimpleNamespace(strategy=SimpleNamespace(reduce=lambda t, reduce_op: t), is_global_zero=True,
                              datamodule=SimpleNamespace(eval_pass_threshold=1.0), max_steps=4, global_step=1,
                              progress_bar_callback=None)
    module = SimpleNamespace(last_metrics=metrics, last_rollout=SimpleNamespace(samples=[{"reward": 1.0}]),
                             device=torch.device("cpu"), log=lambda *a, **kw: None)
    StepSummary().on_train_batch_end(trainer, module, None, None, 0)
    line = capsys.readouterr().out.strip()
    assert line.startswith("[rlflow] step 1/4 | reward 0.500 | accuracy 1.000") and "| loss 0.2500" in line
    assert line.endswith("| loss 0.2500 | GPU peak 12.3 GiB" if gpu else "| loss 0.2500")


@pytest.mark.parametrize("global_step, done, batches, total", [(0, 0, 100, 4), (2, 2, 100, 4), (3, 3, 100, 4),
                                                               (2, 2, 3, 3), (6, 0, 100, 2)])
def test_the_bar_total_counts_the_batches_of_the_epoch_already_run(global_step, done, batches, total):
    """A ``max_steps`` run resumed mid-epoch: the bar's counter starts at the epoch's batches already run, so its
    total is those plus the steps left (``4/4`` at the end of a resumed 4-step run, not Lightning's ``4/1``)."""
    from rlflow.training.callbacks import StepsRichProgressBar

    progress = SimpleNamespace(current=SimpleNamespace(ready=done))
    trainer = SimpleNamespace(max_epochs=-1, max_steps=8 if global_step == 6 else 4, global_step=global_step,
                              num_training_batches=batches,
                              fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=progress)))
    bar = StepsRichProgressBar()
    bar._trainer = trainer
    assert bar.total_train_batches == total
