"""Bad input never costs a run: each case gives one clear message naming what to fix, and no checkpoint is lost."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from rlflow.cli import cli_main, main
from rlflow.data.dataset import DataError
from rlflow.losses.clipped import BNPOLoss
from rlflow.training.checkpointing import CheckpointDiskFullError
from tests.helpers.fit import fit_args

pytestmark = pytest.mark.slow


class NaNLoss(BNPOLoss):
    """BNPO, except that the listed calls (0-based; ``from_call`` on: every later one too) return a NaN loss."""

    def __init__(self, nan_calls: list[int] | None = None, from_call: int | None = None) -> None:
        super().__init__()
        self.nan_calls = set(nan_calls or [])
        self.from_call = from_call
        self.calls = 0

    def __call__(self, logprobs, *args, **kwargs):
        loss, metrics = super().__call__(logprobs, *args, **kwargs)
        call, self.calls = self.calls, self.calls + 1
        if call in self.nan_calls or (self.from_call is not None and call >= self.from_call):
            loss = loss * float("nan")
        return loss, metrics


def args_with_data(tiny_model, tiny_data, root, train_path, *extra, steps=2):
    args = [
        a for a in fit_args(tiny_model, tiny_data, root, *extra, steps=steps)
        if not a.startswith("--data.train_data_path")
    ]
    return [*args, f"--data.train_data_path={train_path}", "--summary.enabled=false", "--model.export_hf=false"]


def run_main(args, capsys) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().err


def rows(tiny_data, n=8):
    return [json.loads(line) for line in (tiny_data / "train.jsonl").read_text().splitlines()[:n]]


def write_rows(path: Path, items) -> Path:
    path.write_text("".join((item if isinstance(item, str) else json.dumps(item)) + "\n" for item in items))
    return path


def no_checkpoints(root: Path) -> bool:
    return not list(root.rglob("*.ckpt"))


def test_missing_data_file_is_one_line(tiny_model, tiny_data, tmp_path, capsys):
    missing = tmp_path / "nope" / "train.jsonl"
    code, err = run_main(args_with_data(tiny_model, tiny_data, tmp_path, missing), capsys)
    assert code == 1
    lines = [l for l in err.splitlines() if l.startswith("rlflow: error:")]
    assert len(lines) == 1 and str(missing) in lines[0] and "not found" in lines[0]
    assert "Traceback" not in err
    assert no_checkpoints(tmp_path)


def test_unreadable_data_file(tiny_model, tiny_data, tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_bytes(json.dumps(rows(tiny_data, 1)[0]).encode() + b"\n\xff\xfe{bad bytes}\n")
    with pytest.raises(DataError, match=rf"{bad}:2: not UTF-8"):
        cli_main(args_with_data(tiny_model, tiny_data, tmp_path, bad))
    if os.geteuid() != 0:  # root reads anything: only a regular user can test permissions
        good = write_rows(tmp_path / "locked.jsonl", rows(tiny_data))
        good.chmod(0)
        with pytest.raises(DataError, match="cannot read"):
            cli_main(args_with_data(tiny_model, tiny_data, tmp_path, good))


def test_empty_dataset(tiny_model, tiny_data, tmp_path):
    empty = tmp_path / "train.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="empty"):
        cli_main(args_with_data(tiny_model, tiny_data, tmp_path, empty))


def test_row_with_wrong_type_names_file_line_field(tiny_model, tiny_data, tmp_path):
    items = rows(tiny_data)
    items[1]["prompt"] = 5
    bad = write_rows(tmp_path / "train.jsonl", items)
    with pytest.raises(DataError,
                       match=rf"{bad}:2: field 'prompt' must be a string or a list of chat messages, got int"):
        cli_main(args_with_data(tiny_model, tiny_data, tmp_path, bad))


def test_missing_ground_truth_is_caught_before_training(tiny_model, tiny_data, tmp_path):
    items = rows(tiny_data)
    del items[2]["reward_model"]["ground_truth"]
    bad = write_rows(tmp_path / "train.jsonl", items)
    with pytest.raises(DataError) as info:
        cli_main(args_with_data(tiny_model, tiny_data, tmp_path, bad))
    message = str(info.value)
    assert f"{bad}:3: judger 'gsm8k' needs column 'ground_truth'" in message and message.startswith("1 train row(s)")
    assert not list(tmp_path.rglob("trajectories.jsonl"))  # nothing was generated
    assert not list(tmp_path.rglob("version_*"))  # and no empty run folder is left behind


def test_tokenizer_without_chat_template(tiny_model, tiny_data, tmp_path):
    plain = tmp_path / "model"
    shutil.copytree(tiny_model, plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(DataError, match="chat template"):
        cli_main(args_with_data(plain, tiny_data, tmp_path, tiny_data / "train.jsonl"))


def test_prompt_repeat_k_of_one_explains_why(tiny_model, tiny_data, tmp_path):
    with pytest.raises(ValueError, match="a group of 1 has no mean or std"):
        cli_main(args_with_data(tiny_model, tiny_data, tmp_path, tiny_data / "train.jsonl", "--data.prompt_repeat_k=1"))


def test_model_path_that_does_not_exist(tiny_model, tiny_data, tmp_path, capsys):
    args = args_with_data(tiny_model, tiny_data, tmp_path, tiny_data / "train.jsonl")
    args = [
        a if not a.startswith("--model.model_path") else f"--model.model_path={tmp_path / 'no-model'}" for a in args
    ]
    code, err = run_main(args, capsys)
    assert code == 1
    line = next(l for l in err.splitlines() if l.startswith("rlflow: error:"))
    assert str(tmp_path / "no-model") in line and "does not exist" in line


def test_nan_loss_step_is_skipped_and_counted(tiny_model, tiny_data, tmp_path):
    loss = '--model.loss={"class_path": "tests.integration.test_bad_input.NaNLoss", "init_args": {"nan_calls": [1]}}'
    cli = cli_main(args_with_data(tiny_model, tiny_data, tmp_path, tiny_data / "train.jsonl", loss, steps=3))
    # a rollout step whose optimizer step was skipped still counts: 3 rollout steps, not a 4th to make up for it
    assert cli.trainer.global_step == 3 and cli.model.skipped_steps == 1 and cli.model.loss_fn.calls == 3
    assert cli.model.policy_version == 2  # optimizer steps actually taken
    metrics = [json.loads(json.dumps(r)) for r in _csv(Path(cli.trainer.log_dir) / "metrics.csv")]
    assert [r["train/skipped_steps"] for r in metrics] == ["0.0", "1.0", "1.0"]
    assert all(r["loss"] != "nan" for r in metrics)


def _csv(path: Path) -> list[dict]:
    import csv

    with open(path) as f:
        return [r for r in csv.DictReader(f) if r.get("train/skipped_steps")]


def test_nan_losses_in_a_row_stop_the_run_and_keep_the_checkpoint(tiny_model, tiny_data, tmp_path, capsys):
    loss = '--model.loss={"class_path": "tests.integration.test_bad_input.NaNLoss", "init_args": {"from_call": 2}}'
    code, err = run_main(args_with_data(tiny_model, tiny_data, tmp_path, tiny_data / "train.jsonl", loss,
                                        "--model.update.max_consecutive_skipped_steps=2", steps=6), capsys)
    assert code == 1
    line = next(l for l in err.splitlines() if l.startswith("rlflow: error:"))
    assert "2 optimizer steps in a row had a NaN or infinite loss" in line and "model.optim.lr" in line
    last = next(tmp_path.rglob("last.ckpt"))
    state = torch.load(last, weights_only=True)  # the checkpoint before the run stopped is intact: rollout step 3,
    assert state["global_step"] == 3 and state["rlflow"]["consecutive_skips"] == 1  # whose update was skipped


def test_disk_full_during_checkpointing_keeps_the_previous_one(tiny_model, tiny_data, tmp_path, monkeypatch):
    real_save, saves = torch.save, []

    def filling_save(obj, f, *args, **kwargs):
        saves.append(obj.get("global_step"))
        if len(saves) > 4 and hasattr(f, "write"):  # step 3's first save: part of the bytes, then the disk is full
            f.write(b"\0" * 1024)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", filling_save)
    with pytest.raises(CheckpointDiskFullError) as info:
        cli_main(args_with_data(tiny_model, tiny_data, tmp_path, tiny_data / "train.jsonl", steps=4))
    message = str(info.value)
    assert "no space left on the device while writing the checkpoint" in message and "step=3.ckpt" in message
    assert "intact" in message and "--ckpt_path last" in message
    last = next(tmp_path.rglob("last.ckpt"))
    monkeypatch.setattr(torch, "save", real_save)
    assert torch.load(last, weights_only=True)["global_step"] == 2
    assert sorted(p.name for p in last.parent.glob("*.ckpt")) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    assert torch.load(last.parent / "epoch=0-step=2.ckpt", weights_only=True)["global_step"] == 2  # not deleted
    assert not list(last.parent.glob(".partial-*"))


@pytest.mark.parametrize("option,line", [
    ("--model.loss={class_path: bnpo, init_args: {kl_type: bogus}}",
     "rlflow: error: model.loss (rlflow.losses.clipped.BNPOLoss): unknown kl_type 'bogus'; choose one of k1, k2, k3"),
    ("--model.loss.kl_type=bogus",
     "rlflow: error: model.loss (rlflow.losses.clipped.BNPOLoss): unknown kl_type 'bogus'; choose one of k1, k2, k3"),
    ("--data.advantage.scale_rewards=grp",
     "rlflow: error: data.advantage (rlflow.advantages.grpo.GRPOAdvantage): scale_rewards must be 'group', 'batch'"),
    ("--data.rollout={class_path: engine, init_args: {max_batch_size: 0}}",
     "rlflow: error: data.rollout (rlflow.rollout.engine.EngineRollout): engine max_batch_size and prefill_batch_size"),
    ("--data.rollout=engin",
     "rlflow: error: data.rollout: unknown rlflow.rollout plugin 'engin'; available: engine, hf"),
    ("--data.rollout={class_path: engine, init_args: {bogus: 1}}",
     "rlflow: error: data.rollout: rlflow.rollout plugin 'engine' has no argument 'bogus'; its arguments: max_batch"),
])
def test_a_bad_plugin_option_is_one_line_naming_the_option_before_the_model_loads(
        tiny_model, tiny_data, tmp_path, capsys, monkeypatch, option, line):
    import transformers

    def no_load(*args, **kwargs):
        raise AssertionError("the policy was loaded before the bad option was reported")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    code, err = run_main(args_with_data(tiny_model, tiny_data, tmp_path, tiny_data / "train.jsonl") + [option], capsys)
    assert code == 1
    errors = [e for e in err.splitlines() if e.startswith("rlflow: error:")]
    assert len(errors) == 1 and errors[0].startswith(line), err[-2000:]
    assert "Traceback" not in err and "Given value" not in err


def one_reward_only(completions, **kwargs):
    """A judger with a bug: one reward whatever the batch size."""
    return [1.0]


def test_a_judger_breaking_its_contract_stops_the_run_with_one_line_naming_it(tiny_model, tiny_data, tmp_path, capsys):
    args = args_with_data(tiny_model, tiny_data, tmp_path, tiny_data / "train.jsonl",
                          '--data.judging.judgers={"*": "tests.integration.test_bad_input:one_reward_only"}')
    code, err = run_main(args, capsys)
    assert code == 1
    errors = [e for e in err.splitlines() if e.startswith("rlflow: error:")]
    assert len(errors) == 1 and "judger 'one_reward_only' returned 1 rewards for" in errors[0]
    assert "Traceback" not in err


def inf_for_odd_lengths(completions, completion_ids, **kwargs):
    """A judger that fails on some samples: an infinite reward for odd-length completions, 1.0 for the others."""
    return [float("inf") if len(ids) % 2 else 1.0 for ids in completion_ids]


def test_samples_a_judger_failed_on_are_marked_in_trajectories(tiny_model, tiny_data, tmp_path):
    judgers = {"*": ["tests.integration.test_bad_input:inf_for_odd_lengths", "gsm8k"]}
    cli = cli_main(fit_args(tiny_model, tiny_data, tmp_path, f"--data.judging.judgers={json.dumps(judgers)}", steps=2))
    log_dir = Path(cli.trainer.log_dir)
    rows = [json.loads(line) for line in (log_dir / "trajectories.jsonl").read_text().splitlines()]
    odd = [r for r in rows if r["num_tokens"] % 2]
    assert odd and len(odd) < len(rows)  # both kinds are there: the check below is not vacuous
    for r in rows:  # marked where (and only where) the judger failed; the gsm8k reward alone stays
        assert r.get("judgers_failed", []) == (["inf_for_odd_lengths"] if r["num_tokens"] % 2 else []), r
        assert r["reward"] in ((0.0, 1.0) if r["num_tokens"] % 2 else (1.0, 2.0)), r
    import csv

    with open(log_dir / "metrics.csv") as f:
        failures = [float(m["judger/failures"]) for m in csv.DictReader(f) if m.get("judger/failures")]
    assert failures == [sum(1 for r in rows if r["step"] == s and r["num_tokens"] % 2) for s in (0, 1)]
