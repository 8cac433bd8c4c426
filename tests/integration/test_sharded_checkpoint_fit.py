"""A crash in the middle of writing an FSDP2 checkpoint folder leaves the previous ``last.ckpt`` folder whole, and
``--ckpt_path last`` continues from it exactly (one FSDP2 rank in this process: the save path of every rank)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from rlflow.cli import cli_main
from tests.helpers.resume_helpers import metrics_by_step, run_args

pytestmark = pytest.mark.slow


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_crash_during_a_sharded_save_keeps_the_previous_checkpoint_and_the_run_continues_from_it(
    tiny_model, small_data, tmp_path, monkeypatch, one_thread
):
    args = run_args(tiny_model, small_data, tmp_path, "--trainer.strategy=fsdp", "--checkpoint.save_top_k=0", steps=2)
    last = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    real_save, before = dcp.save, {}

    def crash_in_the_second_save(state, checkpoint_id, **kwargs):
        if not last.exists():  # step 1's last.ckpt, written whole
            return real_save(state, checkpoint_id=checkpoint_id, **kwargs)
        before.update(files(last))
        Path(checkpoint_id, "__0_0.distcp").write_bytes(b"half a shard")  # step 2's: torn, then the crash
        raise RuntimeError("the writer died")

    monkeypatch.setattr(dcp, "save", crash_in_the_second_save)
    with pytest.raises(RuntimeError, match="the writer died"):
        cli_main(args)
    monkeypatch.undo()
    assert files(last) == before and before.keys() == {".metadata", "__0_0.distcp", "meta.pt"}
    assert torch.load(last / "meta.pt", weights_only=True)["global_step"] == 1  # the previous checkpoint...
    assert not list(tmp_path.rglob(".partial-*"))  # ... and nothing of the torn one
    crashed = [json.loads(line) for line in (last.parent.parent / "trajectories.jsonl").read_text().splitlines()]
    assert {t["step"] for t in crashed} == {0, 1}  # step 2 was sampled and trained before its save failed

    cli = cli_main([*args, "--ckpt_path=last"])
    assert cli.trainer.global_step == 2
    resumed_dir = tmp_path / "lightning_logs" / "version_1"
    assert sorted(metrics_by_step(tmp_path)) == [0, 1]  # step 2 logged once: by the continued run
    resumed = [json.loads(line) for line in (resumed_dir / "trajectories.jsonl").read_text().splitlines()]
    assert resumed == [t for t in crashed if t["step"] == 1]  # the same weights after step 1: the same samples
    assert torch.load(resumed_dir / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=True)["global_step"] == 2
