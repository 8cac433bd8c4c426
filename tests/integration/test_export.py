"""``rlflow export`` (rlflow/training/export.py): a checkpoint's policy as a Hugging Face model, the same as the
policy the run trained; with LoRA the adapter (for PEFT) and the merged model (for transformers), the same as
the end-of-fit export (``model.export_hf``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rlflow.entry import main

#: a graded reward, so the weights move
DIGITS = '--data.judging.judgers={"*": {"class_path": "tests.helpers.resume_helpers.DigitJudger"}}'
IDS = torch.tensor([[5, 9, 17, 23, 42, 11, 7, 30]])


def fit(tiny_model: Path, tiny_data: Path, root: Path, *extra: str, steps: int = 2):
    """A small ``rlflow fit`` of the tiny model (new grouped keys), in process; the CLI object."""
    from rlflow.cli import cli_main

    return cli_main(
        [
            "fit",
            f"--model.model_path={tiny_model}",
            "--model.optim.lr=1e-2",
            f"--data.train_data_path={tiny_data / 'train.jsonl'}",
            "--data.prompt_repeat_k=4",
            "--data.global_batch_size=4",
            "--data.sampling.max_tokens=12",
            DIGITS,
            "--trainer.accelerator=cpu",
            "--trainer.devices=1",
            f"--trainer.max_steps={steps}",
            f"--trainer.default_root_dir={root}",
            "--trainer.logger=csv",
            f"--trainer.logger.save_dir={root}",
            "--trainer.enable_progress_bar=false",
            "--summary.enabled=false",
            *extra,
        ]
    )


def last_ckpt(cli) -> Path:
    return Path(cli.trainer.log_dir) / "checkpoints" / "last.ckpt"


def assert_same_tensors(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_writes_the_trained_policy_of_a_checkpoint(tiny_model, tiny_data, tmp_path, one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cli = fit(tiny_model, tiny_data, tmp_path / "run", "--model.export_hf=false")
    assert not (Path(cli.trainer.log_dir) / "hf").exists()
    trained = {k: v.detach().clone() for k, v in cli.model.policy.state_dict().items()}
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)  # two steps moved the weights

    assert main(["export", "--ckpt_path", str(last_ckpt(cli)), "--out", str(tmp_path / "out")]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert_same_tensors(exported.state_dict(), trained)
    assert AutoTokenizer.from_pretrained(tmp_path / "out").vocab == cli.datamodule.tokenizer.vocab

    # an FSDP2 (distributed) checkpoint folder: its shards, joined, give the same model
    import torch.distributed.checkpoint as dcp

    checkpoint = torch.load(last_ckpt(cli), weights_only=True)
    folder = tmp_path / "sharded.ckpt"
    dcp.save({"state_dict": checkpoint.pop("state_dict")}, checkpoint_id=folder)
    torch.save({k: v for k, v in checkpoint.items() if k != "optimizer_states"}, folder / "meta.pt")
    assert main(["export", "--ckpt_path", str(folder), "--out", str(tmp_path / "from_folder")]) == 0
    assert_same_tensors(AutoModelForCausalLM.from_pretrained(tmp_path / "from_folder").state_dict(), trained)


def test_export_errors_are_one_line(tmp_path, capsys, tiny_model):
    assert main(["export", "--ckpt_path", str(tmp_path / "missing.ckpt"), "--out", str(tmp_path / "o")]) == 1
    assert "rlflow: error: --ckpt_path" in capsys.readouterr().err
    torch.save(
        {"hyper_parameters": {"model_path": str(tiny_model), "lora": None}, "state_dict": {}}, tmp_path / "full.ckpt"
    )
    assert (
        main(["export", "--ckpt_path", str(tmp_path / "full.ckpt"), "--out", str(tmp_path / "o"), "--lora", "adapter"])
        == 1
    )
    assert "--lora applies to a model.lora run" in capsys.readouterr().err


@pytest.mark.slow
@torch.no_grad()
def test_lora_export_of_a_checkpoint_matches_the_end_of_fit_export(tiny_model, tiny_data, tmp_path, one_thread):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cli = fit(
        tiny_model,
        tiny_data,
        tmp_path / "run",
        '--model.lora={"r": 4, "alpha": 8}',
        '--model.loss={"class_path": "grpo", "init_args": {"kl_coef": 0.05}}',
    )
    log_dir = Path(cli.trainer.log_dir)
    live = cli.model.policy.eval()(IDS).logits
    out = tmp_path / "out"
    assert main(["export", "--ckpt_path", str(last_ckpt(cli)), "--out", str(out)]) == 0  # --lora both
    for name in ("hf", "hf_adapter"):  # the same files' tensors as the end-of-fit export wrote
        suffix = "model.safetensors" if name == "hf" else "adapter_model.safetensors"
        from safetensors.torch import load_file

        assert_same_tensors(load_file(out / name / suffix), load_file(log_dir / name / suffix))
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), out / "hf_adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "hf").eval()
    assert torch.allclose(adapted(IDS).logits, live, atol=1e-5)
    assert torch.allclose(merged(IDS).logits, live, atol=1e-4)
    assert not torch.allclose(AutoModelForCausalLM.from_pretrained(tiny_model)(IDS).logits, live, atol=1e-4)
    # one of the two alone, straight into --out
    assert main(["export", "--ckpt_path", str(last_ckpt(cli)), "--out", str(tmp_path / "a"), "--lora", "adapter"]) == 0
    assert (tmp_path / "a" / "adapter_config.json").exists() and not (tmp_path / "a" / "hf").exists()
    for adapter in (tmp_path / "a", log_dir / "hf_adapter"):  # loads from anywhere: the base model's full path
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str(Path(tiny_model).resolve())
    assert main(["export", "--ckpt_path", str(last_ckpt(cli)), "--out", str(tmp_path / "m"), "--lora", "merged"]) == 0
    assert torch.allclose(AutoModelForCausalLM.from_pretrained(tmp_path / "m")(IDS).logits, live, atol=1e-4)
