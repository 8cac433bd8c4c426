"""Monitoring in ``rlflow fit``: W&B (offline, read back from the run's files), TensorBoard, the rollout progress
bar and the step summary."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest

from rlflow.cli import cli_main
from rlflow.training.callbacks import EVAL_SAMPLE_COLUMNS, SAMPLE_COLUMNS, RolloutProgressBar
from tests.helpers.fit import fit_args

pytestmark = pytest.mark.slow
BLOCK = 32768  # the .wandb transaction log is LevelDB's log format: 32 KiB blocks of CRC/length/type-framed records


def wandb_records(path: Path):
    """Every protobuf ``Record`` of a ``run-*.wandb`` file (read independently of wandb's own reader)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw = path.read_bytes()
    assert raw[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(raw):
        if BLOCK - pos % BLOCK < 7:  # block trailer too short for a header: skipped
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos: pos + 7])
        data, pos = raw[pos + 7: pos + 7 + length], pos + 7 + length
        if kind == 0:  # zero padding (the rest of a flushed block): go on at the next block
            pos += -pos % BLOCK
            continue
        pending = data if kind in (1, 2) else pending + data
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            yield record


def settled_records(path: Path, timeout: float = 30.0) -> list:
    """The run file's records once the writer is done: ``finish()`` may return before wandb's service (0.31+) has
    written the last rows, so read until the record count stops growing (or ``timeout`` passes)."""
    import time

    deadline, previous = time.monotonic() + timeout, -1
    while True:
        records = list(wandb_records(path))
        if len(records) == previous or time.monotonic() > deadline:
            return records
        previous = len(records)
        time.sleep(1.0)


def history_row(record) -> dict:
    """One history row as a dict; an item's key is ``key`` or its ``nested_key`` path (a table's fields nest)."""
    row: dict = {}
    for item in record.history.item:
        path = [item.key] if item.key else list(item.nested_key)
        if len(path) == 1 or path[0] not in ("samples", "eval_samples"):
            row["/".join(path)] = json.loads(item.value_json)
        else:
            row.setdefault(path[0], {})["/".join(path[1:])] = json.loads(item.value_json)
    return row


def test_wandb_offline_records_metrics_config_and_sample_tables(tiny_model, tiny_data, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    args = [a for a in fit_args(tiny_model, tiny_data, tmp_path, steps=3) if not a.startswith("--trainer.logger")]
    cli = cli_main([*args, "--trainer.logger", "wandb", "--samples.every_n_steps=2", "--samples.num_samples=6",
                    "--samples.unique_prompts=true", "--model.export_hf=false", "--evaluate_every_n_steps=2",
                    f"--data.eval_data_path={tiny_data / 'val.jsonl'}"])
    logger = cli.trainer.logger
    assert type(logger).__name__ == "WandbLogger" and logger.name == "rlflow"
    logger.experiment.finish()
    run_dir = next((tmp_path / "wandb").glob("offline-run-*"))  # save_dir defaulted to trainer.default_root_dir
    records = settled_records(next(run_dir.glob("run-*.wandb")))

    config = {}
    for r in records:
        if r.WhichOneof("record_type") == "config":
            config.update({u.key: json.loads(u.value_json) for u in r.config.update})
    assert {"model", "data", "trainer", "checkpoint", "seed_everything"} <= set(config)  # the full resolved config
    assert config["data"]["prompt_repeat_k"] == 4 and config["model"]["optim"]["lr"] == 1e-3
    assert config["trainer"]["max_steps"] == 3 and config["checkpoint"]["save_last"] is True

    history = [history_row(r) for r in records if r.WhichOneof("record_type") == "history"]
    steps = [h for h in history if "reward" in h]
    assert [h["trainer/global_step"] for h in steps] == [0, 1, 2]
    for name in ("reward", "reward_std", "loss", "entropy", "grad_norm", "num_tokens", "lr", "step_time",
                 "completions/mean_length", "completions/clipped_ratio", "train/accuracy", "train/skipped_steps",
                 "rollout/tokens_per_s"):
        assert all(name in h for h in steps), name
    last = cli.model.last_metrics
    assert steps[-1]["reward"] == pytest.approx(last["reward"]) and steps[-1]["num_tokens"] == last["num_tokens"]

    tables = [h for h in history if "samples" in h]
    assert [h["trainer/global_step"] for h in tables] == [0, 2]  # the first step, then every 2nd
    table = json.loads((run_dir / "files" / tables[-1]["samples"]["path"]).read_text())
    assert table["columns"] == SAMPLE_COLUMNS and len(table["data"]) == 4  # unique prompts: 4 groups of 4
    trajectories = [json.loads(l) for l in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    step2 = [t for t in trajectories if t["step"] == 2][::4]  # each group's first completion
    col = {c: i for i, c in enumerate(SAMPLE_COLUMNS)}
    assert [row[col["reward"]] for row in table["data"]] == [t["reward"] for t in step2]
    assert [row[col["completion"]] for row in table["data"]] == [t["completion"] for t in step2]
    assert [row[col["judgers_failed"]] for row in table["data"]] == [""] * 4  # no judger failed in this run
    assert len({json.dumps(row[col["prompt"]]) for row in table["data"]}) == 4

    eval_tables = [h for h in history if "eval_samples" in h]  # one evaluation, after rollout step 2
    assert len(eval_tables) == 1
    table = json.loads((run_dir / "files" / eval_tables[0]["eval_samples"]["path"]).read_text())
    assert table["columns"] == EVAL_SAMPLE_COLUMNS and len(table["data"]) == 6
    eval_rows = [json.loads(l) for l in (tmp_path / "eval_trajectories.jsonl").read_text().splitlines()][:6]
    col = {c: i for i, c in enumerate(EVAL_SAMPLE_COLUMNS)}
    for name in ("trained_steps", "prompt", "completion", "reward", "correct"):
        assert [row[col[name]] for row in table["data"]] == [r[name] for r in eval_rows], name


@pytest.mark.parametrize("alias", ["tensorboard", "csv"])
def test_the_csv_and_tensorboard_short_names_work_as_documented(tiny_model, tiny_data, tmp_path, monkeypatch, alias):
    """``--trainer.logger csv`` alone (docs/monitoring.md): its files under ``./lightning_logs/version_N``."""
    if alias == "tensorboard":
        pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)
    args = [a for a in fit_args(tiny_model, tiny_data, tmp_path, steps=1)
            if not a.startswith(("--trainer.logger", "--trainer.default_root_dir"))]
    cli = cli_main([*args, f"--trainer.logger={alias}", "--model.export_hf=false"])
    log_dir = Path(cli.trainer.log_dir)
    assert log_dir == tmp_path / "lightning_logs" / "version_0"
    assert list(log_dir.glob("events.out.tfevents.*" if alias == "tensorboard" else "metrics.csv"))
    assert "prompt_repeat_k: 4" in (log_dir / "hparams.yaml").read_text()  # the resolved config reached the logger


def test_rollout_progress_and_step_summary(tiny_model, tiny_data, tmp_path, capsys):
    args = [a for a in fit_args(tiny_model, tiny_data, tmp_path, steps=2) if a != "--trainer.enable_progress_bar=false"]
    cli = cli_main([*args, "--model.export_hf=false"])
    bar = next(c for c in cli.trainer.callbacks if isinstance(c, RolloutProgressBar))
    assert bar.lightning_bar is cli.trainer.progress_bar_callback  # drawn beside Lightning's bar
    trajectories = [json.loads(l) for l in (Path(cli.trainer.log_dir) / "trajectories.jsonl").read_text().splitlines()]
    last_step = [t for t in trajectories if t["step"] == 1]
    assert bar.last_rollout["completions"] == bar.last_rollout["total"] == 16  # 4 prompts x 4 completions
    assert bar.last_rollout["tokens"] == sum(t["num_tokens"] for t in last_step)
    out = capsys.readouterr().out
    lines = [l for l in out.splitlines() if l.startswith("[rlflow] step ")]
    assert len(lines) == 2 and lines[1].startswith("[rlflow] step 2/2 |")
    reward = float(re.search(r"reward ([0-9.]+)", lines[1]).group(1))
    assert reward == pytest.approx(sum(t["reward"] for t in last_step) / 16, abs=5e-4)
    for part in ("accuracy", "length", "clipped", "s/step", "tok/s"):
        assert part in lines[1]

