"""Vision-language GRPO through ``rlflow fit`` on a tiny random Qwen2.5-VL (tests/helpers/tiny_vlm.py): one step on
the ``hf`` backend whose export reloads with its processor, and pipelined generation with images is one config
error."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from rlflow.config_error import ConfigError
from rlflow.data.images import open_image
from rlflow.models.vision import load_processor, model_auto_class
from tests.helpers import tiny_vlm
from tests.helpers.fit import fit_args
from tests.unit.models.test_vision import encode, image_bytes


@pytest.fixture(scope="module")
def processor():
    return tiny_vlm.build_processor()


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory) -> Path:
    return tiny_vlm.build(tmp_path_factory.mktemp("vlm") / "model")


@pytest.fixture(scope="module")
def squares(tmp_path_factory) -> Path:
    return tiny_vlm.write_squares_data(tmp_path_factory.mktemp("squares") / "data", rows=4)


# ------------------------------------------------------------------------------------------- end to end
def image_judger(completions, images, ground_truth, **kwargs):
    """Reads every image it is given (so a judger can use them); rewards the length of the completion."""
    for refs in images:
        for ref in refs:
            open_image(ref)
    return [len(c[0]["content"]) / 10 for c in completions]


@pytest.mark.slow
def test_fit_one_step_on_hf_and_the_export_reloads_with_its_processor(vlm_dir, squares, tmp_path):
    from rlflow.cli import cli_main

    args = fit_args(
        vlm_dir,
        squares.parent,
        tmp_path,
        "--data.rollout=auto",
        "--data.sampling.max_tokens=6",
        "--data.judging.judgers={'*': 'tests.integration.test_vision_fit:image_judger'}",
        "--model.loss.kl_coef=0.01",
        f"--data.eval_data_path={squares}",
        "--evaluate_every_n_steps=1",
        steps=1,
    )
    args = [a for a in args if not a.startswith("--data.train_data_path")] + [f"--data.train_data_path={squares}"]
    cli = cli_main(args)
    module = cli.model
    assert type(cli.datamodule.backend).__name__ == "HFRollout"  # auto fell back: the engine refuses VLMs
    assert module.packing is False  # packing refused for VLMs: padded micro-batches
    log_dir = Path(cli.trainer.log_dir)
    rows = list(csv.DictReader((log_dir / "metrics.csv").open()))
    (train,) = [r for r in rows if r["loss"]]
    assert float(train["kl"]) >= 0.0
    assert float(train["judger/failures"]) == 0.0  # the judger opened every image it was given
    assert any(r.get("eval/accuracy") not in (None, "") for r in rows)  # evaluation generates with the images too
    export = log_dir / "hf"
    reloaded = model_auto_class(str(export)).from_pretrained(str(export))
    processor = load_processor(str(export))
    assert type(reloaded).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert processor.tokenizer.get_vocab() == tiny_vlm.build_tokenizer().get_vocab()
    initial = model_auto_class(str(vlm_dir)).from_pretrained(str(vlm_dir)).state_dict()
    trained = reloaded.state_dict()
    tower = [k for k in trained if ".visual." in k or k.startswith("model.visual")]
    assert tower and all(torch.equal(trained[k], initial[k]) for k in tower)  # frozen by default
    assert any(not torch.equal(trained[k], initial[k]) for k in trained if k not in tower)
    enc = encode(processor, "How many red squares?", [image_bytes({"red": 1}, 0)])
    with torch.no_grad():
        assert torch.isfinite(reloaded(**enc).logits).all()
    # a finished run continues (the replay buffer and its image references come back from the checkpoint)
    resumed = cli_main(
        [*[a for a in args if not a.startswith("--trainer.max_steps")], "--trainer.max_steps=2", "--ckpt_path=last"]
    )
    assert resumed.trainer.global_step == 2
    resumed_rows = [r for r in csv.DictReader((Path(resumed.trainer.log_dir) / "metrics.csv").open()) if r["loss"]]
    assert [int(r["step"]) for r in resumed_rows] == [1]  # it went on from the checkpoint: one more step only


@pytest.mark.slow
def test_pipelined_generation_with_images_is_one_config_error(vlm_dir, squares, tmp_path):
    from rlflow.cli import cli_main

    args = fit_args(
        vlm_dir,
        squares.parent,
        tmp_path,
        "--data.pipeline.max_staleness=1",
        "--data.judging.judgers={'*': 'tests.integration.test_vision_fit:image_judger'}",
        steps=1,
    )
    args = [a for a in args if not a.startswith("--data.train_data_path")] + [f"--data.train_data_path={squares}"]
    with pytest.raises(ConfigError, match="images are not pipelined.*data.pipeline.max_staleness=0"):
        cli_main(args)
