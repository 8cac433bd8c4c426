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



@pytest.mark.slow
def test_fit_from_a_hub_dataset_in_the_cache(tiny_model, tiny_data, tmp_path, monkeypatch, capsys):
    """A hub id read from the local ``datasets`` cache, offline, in TRL's conversational layout: each completion's
    reward is its row's ``solution`` (the judger echoes it); a hub id not in the cache is one ``rlflow: error:``
    line saying how to download it."""
    import datasets

    from rlflow.cli import cli_main, main
    from tests.helpers.hub_cache import cache_hub_dataset

    rows = [json.loads(line) for line in (tiny_data / "train.jsonl").read_text().splitlines()[:16]]
    trl_rows = [{"prompt": r["prompt"], "solution": r["reward_model"]["ground_truth"]} for r in rows]
    cache = tmp_path / "hf_datasets"
    cache_hub_dataset(cache, "tiny/arith", "default", {"train": trl_rows, "test": trl_rows[:4]})
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    judgers = json.dumps({"*": "tests.helpers.reward_helpers:solution_echo"})
    args = [a for a in fit_args(tiny_model, tiny_data, tmp_path, f"--data.judging.judgers={judgers}",
                                "--model.export_hf=false", "--summary.enabled=false", steps=2)
            if not a.startswith("--data.train_data_path")]
    assert main([*args, "--data.train_data_path=hf://tiny/missing?split=train"]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlflow: error:")]
    assert len(errors) == 1
    error = errors[0]
    assert error.startswith("rlflow: error: data.train_data_path: hf://tiny/missing?split=train: not in the local "
                            f"datasets cache {cache}") and "load_dataset('tiny/missing')" in error

    cli = cli_main([*args, "--data.train_data_path=hf://tiny/arith?split=train"])
    assert cli.trainer.global_step == 2
    trajectories = [json.loads(line)
                    for line in (Path(cli.trainer.log_dir) / "trajectories.jsonl").read_text().splitlines()]
    assert len(trajectories) == 2 * 4 * 4  # steps x prompts x completions
    for t in trajectories:  # the row's own `solution` reached the judger
        solutions = [r["solution"] for r in trl_rows if f"{r['prompt'][0]['content']}<" in t["prompt"]]
        assert len(solutions) == 1 and t["reward"] == float(solutions[0])
