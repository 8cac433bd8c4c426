"""``model.lora`` adapters that do not merge into plain weights (DoRA) beside the generator process, whose copy of the
policy is the merged plain model: the split rollout (``data.pipeline.split_rollout``) goes off with its reason, and
pipelining (``data.pipeline.max_staleness``) is refused in one line before anything is copied or generated."""

from __future__ import annotations

import logging

import pytest

from tests.helpers.fit import fit_args

pytest.importorskip("peft", reason="LoRA needs PEFT: pip install 'rlflow[lora]'")
pytestmark = pytest.mark.slow

DORA = '--model.lora={"r": 4, "options": {"use_dora": true}}'
WHY = "model.lora cannot be merged (the LoRA layer model.layers.0.self_attn.q_proj: a LoRA layer uses a variant (DoRA"


def test_dora_leaves_the_split_off_with_its_reason_and_the_fit_finishes(tiny_model, small_data, tmp_path, caplog):
    from rlflow.cli import cli_main
    from rlflow.rollout.split import torch_threads

    with torch_threads(2), caplog.at_level(logging.INFO, logger="rlflow"):  # threads enough for a split
        cli = cli_main(fit_args(tiny_model, small_data, tmp_path, DORA, "--data.pipeline.split_rollout=true",
                                "--model.export_hf=false", steps=2))
    assert cli.trainer.global_step == 2
    assert cli.datamodule.split is None and not cli.datamodule.split_rollout
    lines = [r.getMessage() for r in caplog.records if "split_rollout is off" in r.getMessage()]
    off = "data.pipeline.split_rollout is off for this run: the generator process decodes a merged copy of the policy"
    assert len(lines) == 1 and lines[0].startswith(f"{off}, and {WHY}"), lines


def test_pipelining_dora_is_refused_in_one_line_before_the_generator_copies_anything(
    tiny_model, small_data, tmp_path, capsys, monkeypatch
):
    from rlflow.cli import main

    copied = []
    monkeypatch.setattr("rlflow.rollout.process.generator_copy", lambda policy: copied.append(policy))
    code = main(fit_args(tiny_model, small_data, tmp_path, DORA, "--data.pipeline.max_staleness=1", steps=2))
    err = capsys.readouterr().err
    assert code != 0 and copied == []
    assert f"rlflow: error: data.pipeline.max_staleness=1 generates from a merged copy of the policy, and {WHY}" in err
    assert "set data.pipeline.max_staleness=0 or use plain LoRA" in err
