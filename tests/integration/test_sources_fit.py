"""``rlflow fit`` on a weighted mix of sources logs per-source rewards."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.helpers.fit import fit_args


@pytest.mark.slow
def test_fit_on_a_weighted_mix_logs_per_source_rewards(tiny_model, tiny_data, tmp_path):
    from rlflow.cli import cli_main

    rows = [json.loads(line) for line in (tiny_data / "train.jsonl").read_text().splitlines()[:40]]
    for row in rows:
        row["data_source"] = "arith/parquet"
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "other.parquet")
    sources = json.dumps([
        {"path": str(tiny_data / "train.jsonl"), "weight": 3},
        {"path": str(tmp_path / "other.parquet"), "weight": 1, "judgers": "gsm8k", "name": "other"},
    ])
    args = [a for a in fit_args(tiny_model, tiny_data, tmp_path, steps=2) if not a.startswith("--data.train_data_path")]
    cli = cli_main([*args, f"--data.train_data_path={sources}", "--model.export_hf=false"])
    log_dir = Path(cli.trainer.log_dir)
    with open(log_dir / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f)]
    assert all(row["reward/openai/gsm8k"] != "" and row["reward/arith/parquet"] != "" for row in rows)
    trajectories = [json.loads(line) for line in (log_dir / "trajectories.jsonl").read_text().splitlines()]
    for step in (0, 1):  # batch 4 at weights 3:1 -> 3 prompts of one, 1 of the other, 4 completions each
        sources_of_step = [t["data_source"] for t in trajectories if t["step"] == step]
        assert sources_of_step.count("openai/gsm8k") == 12 and sources_of_step.count("arith/parquet") == 4
    # each logged per-source reward is the mean of that source's trajectories at that step
    for step, row in enumerate(rows):
        mine = [t["reward"] for t in trajectories if t["step"] == step and t["data_source"] == "arith/parquet"]
        assert float(row["reward/arith/parquet"]) == pytest.approx(sum(mine) / len(mine))

