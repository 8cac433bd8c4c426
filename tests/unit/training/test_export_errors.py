"""``rlflow export`` of a file that is not a readable checkpoint: one ``rlflow: error:`` line naming the file, never
a traceback, never torch's advice to load it with ``weights_only=False``."""

from __future__ import annotations

import pytest
import torch

from rlflow.training.export import main


class Note:
    """Not a tensor nor a plain value: ``torch.load(weights_only=True)`` refuses it."""


def export(capsys, path, tmp_path) -> tuple[int, list[str]]:
    code = main(["--ckpt_path", str(path), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "weights_only=False" not in err and "Traceback" not in err
    return code, [line for line in err.splitlines() if line.strip() and not line.startswith("(set ")]


def test_a_truncated_checkpoint_is_one_line(tmp_path, capsys):
    whole = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"policy.w": torch.zeros(4096)}, "hyper_parameters": {}}, whole)
    truncated = tmp_path / "t.ckpt"
    truncated.write_bytes(whole.read_bytes()[:1000])
    code, lines = export(capsys, truncated, tmp_path)
    assert code == 1
    assert lines == [f"rlflow: error: --ckpt_path {truncated} is not a readable rlflow checkpoint: the file is "
                     "truncated (1000 bytes of a zip archive without its end: an interrupted write or copy)"]


def test_a_text_file_is_not_a_checkpoint(tmp_path, capsys):
    for text in ("not a checkpoint\n", "hello world\n", ""):
        path = tmp_path / "notes.ckpt"
        path.write_text(text)
        code, lines = export(capsys, path, tmp_path)
        assert code == 1
        assert lines == [f"rlflow: error: --ckpt_path {path} is not a readable rlflow checkpoint: the file is not a "
                         f"checkpoint ({len(text)} bytes, not the zip archive torch.save writes)"]


def test_a_whole_file_without_a_state_dict_or_with_objects_is_refused(tmp_path, capsys):
    path = tmp_path / "list.ckpt"
    torch.save([1, 2], path)
    code, lines = export(capsys, path, tmp_path)
    assert code == 1
    assert lines == [f"rlflow: error: --ckpt_path {path} is not a checkpoint of rlflow fit (it holds no state_dict)"]
    path = tmp_path / "objects.ckpt"
    torch.save({"state_dict": {}, "note": Note()}, path)
    code, lines = export(capsys, path, tmp_path)
    assert code == 1 and len(lines) == 1
    assert lines[0].startswith(f"rlflow: error: --ckpt_path {path}: the checkpoint holds more than tensors and "
                               f"plain values (Unsupported global: GLOBAL {__name__}.Note was not an allowed global "
                               "by default.); rlflow reads checkpoints with torch.load(weights_only=True) only")


def test_a_runs_relative_model_path_is_found_from_anywhere(tmp_path, monkeypatch):
    """``rlflow export`` run from another folder than the run: the model named relative to where the run started
    is found above the checkpoint, and returned absolute (an exported adapter's base model loads from anywhere)."""
    from rlflow.config_error import ConfigError
    from rlflow.training.export import run_model_path

    start = tmp_path / "project"
    (start / "checkpoints" / "model").mkdir(parents=True)
    (start / "checkpoints" / "model" / "config.json").write_text("{}")
    ckpt = start / "runs" / "demo" / "version_0" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert run_model_path("checkpoints/model", ckpt) == str(start / "checkpoints" / "model")
    assert run_model_path("Qwen/Qwen3-8B", ckpt) == "Qwen/Qwen3-8B"  # a hub id stays one
    assert run_model_path("/abs/model", ckpt) == "/abs/model"
    with pytest.raises(ConfigError, match=r"'./models/m' \(relative to where the run started\) is neither here "
                                          r"nor above the checkpoint; pass --model_path"):
        run_model_path("./models/m", ckpt)


def test_an_out_that_is_a_file_the_base_model_or_not_creatable_is_refused_before_loading(tmp_path):
    from rlflow.config_error import ConfigError
    from rlflow.training.export import check_out

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"is the base model's own directory \(model.model_path\)"):
        check_out(tmp_path / "." / "base", str(base))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"--out .*file is a file; give a directory"):
        check_out(tmp_path / "file", str(base))
    with pytest.raises(ConfigError, match=r"--out .*file/sub cannot be created: "):
        check_out(tmp_path / "file" / "sub", str(base))
    assert (base / "config.json").read_text() == "{}"
    check_out(tmp_path / "new" / "export", str(base))  # created, parents too
    assert (tmp_path / "new" / "export").is_dir()
