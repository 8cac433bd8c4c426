"""``rlflow fit`` on a weighted mix, resumed mid-stream: the same mixed batches as the straight run."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_fit_resumed_mid_stream_draws_the_same_mixed_batches(tiny_model, tiny_data, tmp_path):
    import json
    from pathlib import Path

    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlflow.cli import cli_main
    from tests.helpers.fit import fit_args

    rows = [json.loads(line) for line in (tiny_data / "val.jsonl").read_text().splitlines()[:10]]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "small.parquet")
    sources = json.dumps([str(tiny_data / "train.jsonl"), {"path": str(tmp_path / "small.parquet"), "weight": 1}])

    def run(root, steps, *extra):
        args = [
            a for a in fit_args(tiny_model, tiny_data, root, steps=steps) if not a.startswith("--data.train_data_path")
        ]
        cli = cli_main([*args, f"--data.train_data_path={sources}", "--model.export_hf=false", *extra])
        return Path(cli.trainer.log_dir)

    def prompts_by_step(log_dir):
        out = {}
        for line in (log_dir / "trajectories.jsonl").read_text().splitlines():
            t = json.loads(line)
            out.setdefault(t["step"], []).append(t["prompt"])
        return out

    first = run(tmp_path / "b", 1)
    resumed = prompts_by_step(run(tmp_path / "b", 3, f"--ckpt_path={first / 'checkpoints' / 'last.ckpt'}"))
    assert sorted(resumed) == [1, 2]
    # what an uninterrupted run draws at steps 1 and 2: the same sources, through a fresh sampler
    from rlflow.data.datamodule import RolloutDataModule

    dm = RolloutDataModule(train_data_path=json.loads(sources), tokenizer_path=str(tiny_model), global_batch_size=4)
    dm.setup("fit")
    batches = [dm.sampler.next_batch() for _ in range(3)]
    for step in (1, 2):
        assert resumed[step] == [dm.train_records[i].prompt_text for i in batches[step] for _ in range(4)]

