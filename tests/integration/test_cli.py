"""End to end: ``rlflow fit`` on the tiny model, config handling, and the HF export."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch

from rlflow.cli import cli_main, main
from tests.helpers.fit import fit_args
from tests.helpers.paths import ROOT

pytestmark = pytest.mark.slow


def read_metrics(log_dir):
    with open(log_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


def test_fit_three_steps_end_to_end(tiny_model, tiny_data, tmp_path, monkeypatch):
    import rlflow.training.module as module

    asked = []  # model.update.reuse_freed_memory reaches the allocator setting, with the policy's device
    monkeypatch.setattr(module, "reuse_freed_memory", lambda choice, device: asked.append((choice, device.type)))
    cli = cli_main(fit_args(tiny_model, tiny_data, tmp_path, "--model.loss.kl_coef=0.01",
                            "--model.update.reuse_freed_memory=false", steps=3))
    trainer = cli.trainer
    assert trainer.global_step == 3
    assert asked == [(False, "cpu")]
    log_dir = __import__("pathlib").Path(trainer.log_dir)
    rows = read_metrics(log_dir)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for name in ("reward", "reward_std", "frac_reward_zero_std", "rewards/gsm8k/mean", "completions/mean_length",
                 "completions/clipped_ratio", "entropy", "kl", "clip_ratio/region_mean", "loss", "grad_norm",
                 "num_tokens", "step_time"):
        assert name in rows[-1], name
    # the trainer's peak resident memory (never falling), in GiB, on every step; no CUDA figures on a CPU run
    rss = [r["memory/max_rss_gb"] for r in rows]
    assert 0.1 < rss[0] <= rss[1] <= rss[2] < 64 and "memory/max_allocated_gb" not in rows[-1]
    # num_tokens is cumulative: it grows every step
    assert rows[0]["num_tokens"] < rows[1]["num_tokens"] < rows[2]["num_tokens"]
    assert all(0.0 <= r["completions/clipped_ratio"] <= 1.0 for r in rows)
    assert all(r["completions/mean_length"] <= 12 for r in rows)
    # trajectories: 3 steps x 4 prompts x 4 completions, with rewards and advantages
    lines = [json.loads(l) for l in (log_dir / "trajectories.jsonl").read_text().splitlines()]
    assert len(lines) == 3 * 4 * 4
    assert {l["step"] for l in lines} == {0, 1, 2}
    assert all({"prompt", "completion", "reward", "advantage"} <= set(l) for l in lines)
    # a Lightning checkpoint was written
    assert list((log_dir / "checkpoints").glob("*.ckpt"))


def test_hf_export_reloads_with_identical_logits(tiny_model, tiny_data, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cli = cli_main(fit_args(tiny_model, tiny_data, tmp_path, steps=1))
    hf_dir = __import__("pathlib").Path(cli.trainer.log_dir) / "hf"
    reloaded = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    AutoTokenizer.from_pretrained(hf_dir)  # the tokenizer is exported beside it
    policy = cli.model.policy.eval()
    ids = torch.tensor([[5, 9, 17, 23, 42, 11]])
    with torch.no_grad():
        assert torch.equal(policy(ids).logits, reloaded(ids).logits)
    # and the weights actually moved away from the initial model (lr 1e-3, one step)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    with torch.no_grad():
        assert not torch.equal(initial(ids).logits, reloaded(ids).logits) or cli.model.last_metrics["grad_norm"] == 0


def test_print_config_and_console_script(tiny_model, tiny_data, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "rlflow", *fit_args(tiny_model, tiny_data, tmp_path)[:8], "--print_config"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "prompt_repeat_k: 4" in out.stdout
    assert f"tokenizer_path: {tiny_model}" in out.stdout or "model_path" in out.stdout


def test_prompt_repeat_k_of_one_is_refused(tiny_model, tiny_data, tmp_path):
    with pytest.raises(ValueError, match="at least 2"):
        cli_main(fit_args(tiny_model, tiny_data, tmp_path, "--data.prompt_repeat_k=1"))


def test_validate_reports_eval_accuracy(tiny_model, tiny_data, tmp_path):
    args = fit_args(tiny_model, tiny_data, tmp_path, f"--data.eval_data_path={tiny_data / 'val.jsonl'}")
    args[0] = "validate"
    args = [a for a in args if not a.startswith("--trainer.max_steps")]
    cli = cli_main(args)
    metrics = cli.trainer.callback_metrics
    assert "eval/accuracy" in metrics and 0.0 <= float(metrics["eval/accuracy"]) <= 1.0


def test_kl_coef_in_the_losss_init_args_loads_a_reference_and_trains_with_kl(tiny_model, tiny_data, tmp_path):
    loss = '--model.loss={"class_path": "grpo", "init_args": {"kl_coef": 0.01}}'
    cli = cli_main(fit_args(tiny_model, tiny_data, tmp_path, loss, "--model.export_hf=false", steps=1))
    assert cli.trainer.global_step == 1
    assert type(cli.model.loss_fn).__name__ == "GRPOLoss" and cli.model.loss_fn.kl_coef == 0.01
    assert cli.model.ref_model is not None
    assert "kl" in read_metrics(__import__("pathlib").Path(cli.trainer.log_dir))[-1]


def test_loss_options_and_max_tokens_reach_the_plugin_specs(tiny_model, tiny_data, tmp_path):
    judgers = '--data.judging.judgers={"*": ["gsm8k", {"class_path": "overlong"}]}'
    loss = '--model.loss={"class_path": "dapo", "init_args": {"clip_ratio_c": 3.0}}'
    cli = cli_main(fit_args(tiny_model, tiny_data, tmp_path, judgers, loss, "--model.loss.epsilon_high=0.28",
                            "--data.rollout={class_path: hf, init_args: {batch_size: 2}}")[1:], run=False)
    loss_fn = cli.model.loss_fn
    assert type(loss_fn).__name__ == "DAPOLoss" and loss_fn.epsilon_high == 0.28 and loss_fn.clip_ratio_c == 3.0
    assert loss_fn.max_tokens == 12 and not cli.model.uses_reference
    assert cli.datamodule.judges.default.judgers["overlong"].max_tokens == 12  # from data.sampling.max_tokens
    assert cli.datamodule.rollout_spec.batch_size == 2


def test_plugin_help_documents_the_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--model.loss.help", "grpo"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "--model.loss.kl_coef" in out and "--model.loss.clip_ratio_c" in out


@pytest.mark.parametrize("args", [["--data.judging.judgers.help", "env_reward"],
                                  ["--data.judging.judgers.help=tests.helpers.reward_helpers:reward_len"]])
def test_judger_help_documents_a_function_judger(capsys, args):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", *args])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    name = args[-1].split("=")[-1]
    doc = "summed reward of each trajectory" if name == "env_reward" else "prefer completions of about 5 characters"
    assert out.startswith(f"{name}: a function judger") and doc in out and "takes no options" in out


def test_judger_help_still_documents_classes_and_lists_names(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--data.judging.judgers.help", "gsm8k"])
    assert exit_info.value.code == 0 and "--data.judging.judgers.format_score" in capsys.readouterr().out
    assert main(["fit", "--data.judging.judgers.help", "nope"]) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rlflow: error:")]
    assert len(lines) == 1 and "unknown rlflow.judgers plugin 'nope'; available: " in lines[0]


@pytest.mark.parametrize("spelling", ["rlflow.losses.clipped:DAPOLoss", "rlflow.losses.clipped.DAPOLoss", "dapo"])
def test_plugin_help_takes_every_spelling_of_a_class(capsys, spelling):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--model.loss.help", spelling])  # pkg.module:Class is the registry's import-path spelling
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    assert "Help for --model.loss.help=rlflow.losses." in out and "DAPOLoss" in out
    assert "--model.loss.epsilon_high" in out


def test_the_default_rich_bar_of_a_max_steps_run_has_no_negative_epoch_total(tiny_model, tiny_data, tmp_path):
    """Lightning labels its rich bar "Epoch 0/-2" when ``max_steps`` bounds the run (``max_epochs`` is -1); rlflow's
    default bar says "Epoch 0". A configured bar, or progress bars off, are left as they are."""
    pytest.importorskip("rich")
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    from rlflow.training.callbacks import StepsRichProgressBar

    args = [a for a in fit_args(tiny_model, tiny_data, tmp_path, steps=1)[1:] if "enable_progress_bar" not in a]
    cli = cli_main(args, run=False)
    bar = cli.trainer.progress_bar_callback
    assert type(bar) is StepsRichProgressBar
    from lightning.pytorch.loops.utilities import _parse_loop_limits

    trainer = cli.trainer  # the loop limits Trainer._run sets at fit: max_steps bounds the run, max_epochs is -1
    trainer.fit_loop.max_epochs = _parse_loop_limits(None, trainer.max_steps, None, trainer.max_epochs, trainer)[1]
    assert trainer.max_epochs == -1
    plain = RichProgressBar()
    for b in (bar, plain):
        b._trainer = cli.trainer
    assert plain._get_train_description(0).strip() == "Epoch 0/-2"  # what Lightning's own bar says
    assert bar._get_train_description(0).strip() == "Epoch 0"
    cli.trainer.fit_loop.max_epochs = 3
    assert bar._get_train_description(1).strip() == "Epoch 1/2"  # a bound on epochs is still shown
    own = cli_main([*args, "--trainer.callbacks+=lightning.pytorch.callbacks.TQDMProgressBar"], run=False)
    assert type(own.trainer.progress_bar_callback) is TQDMProgressBar
    off = cli_main([*args, "--trainer.enable_progress_bar=false"], run=False)
    assert off.trainer.progress_bar_callback is None


def test_library_warnings_a_user_cannot_act_on_are_not_shown(tiny_model, tiny_data, tmp_path, monkeypatch):
    """Three warnings Lightning raises on rlflow runs, each first seen raised without rlflow's filter: torch's
    LeafSpec FutureWarning (Lightning's data fetcher, every run), the DataLoader-workers hint (any machine with
    more than 2 cores, simulated here) and "Total length of `list`" (no eval data). rlflow's CLI filters them."""
    import warnings
    from types import SimpleNamespace

    import lightning.pytorch.trainer.connectors.data_connector as data_connector
    from lightning.pytorch.utilities._pytree import _tree_flatten
    from lightning.pytorch.utilities.data import has_len_all_ranks
    from torch.utils.data import DataLoader

    monkeypatch.setattr(data_connector, "suggested_max_num_workers", lambda devices: 15)  # a 16-core machine
    messages = {"LeafSpec": "LeafSpec", "workers": "does not have many workers",
                "empty": "Total length of `list` across ranks is zero"}
    with warnings.catch_warnings(record=True) as raw:
        warnings.simplefilter("always")
        _tree_flatten([1, {"a": [2]}])
        data_connector._worker_check(SimpleNamespace(num_devices=1, reload_dataloaders_every_n_epochs=0),
                                     DataLoader([1, 2]), "train_dataloader")
        has_len_all_ranks([], SimpleNamespace(reduce=lambda t, reduce_op: t, root_device="cpu"))
    raised = {key for key, text in messages.items() if any(text in str(w.message) for w in raw)}
    assert {"workers", "empty"} <= raised  # LeafSpec: only where this torch/Lightning pair deprecates it
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cli_main(fit_args(tiny_model, tiny_data, tmp_path, "--data.eval_data_path=null", steps=1))
    shown = [str(w.message) for w in seen if any(messages[key] in str(w.message) for key in raised)]
    assert not shown


@pytest.mark.parametrize("where", ["flag", "yaml"])
def test_precision_auto_is_accepted_from_a_flag_or_a_config_and_resolved(tiny_model, tiny_data, tmp_path, where):
    from rlflow.training.trainer import auto_precision

    args = fit_args(tiny_model, tiny_data, tmp_path, steps=1)[1:]
    if where == "flag":
        args.append("--trainer.precision=auto")
    else:
        config = tmp_path / "precision.yaml"
        config.write_text("trainer:\n  precision: auto\n")
        args.append(f"--config={config}")
    cli = cli_main(args, run=False)
    assert cli.trainer.precision == auto_precision("cpu")[0]


def test_the_help_lists_precision_auto(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    section = out[out.index("  --trainer.precision PRECISION\n"):][:600]  # the option's entry, not the usage line
    assert "auto" in section and "bf16-mixed" in section, section
