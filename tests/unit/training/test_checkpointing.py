"""The checkpoint writer's failure modes: a full disk as torch reports it, a directory that takes no file, and the
``save_last="link"`` link replaced atomically."""

from __future__ import annotations

import errno
import os
from types import SimpleNamespace

import pytest
import torch

from rlflow.config_error import ConfigError
from rlflow.training.checkpointing import (
    CheckpointDiskFullError,
    RLFlowCheckpoint,
    atomic_torch_save,
    check_writable,
    disk_full,
)


def full_disk_save(obj, f, *args, **kwargs):
    """What ``torch.save`` does on a full disk: part of the file written, then the zip writer's ``RuntimeError``
    raised while the file's ``OSError(ENOSPC)`` is handled."""
    f.write(b"PK\x03\x04" + bytes(100))
    try:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None


def test_a_full_disk_is_one_error_naming_the_directory_and_the_space_needed(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    atomic_torch_save({"step": 1, "w": torch.zeros(4)}, path)
    monkeypatch.setattr(torch, "save", full_disk_save)
    with pytest.raises(CheckpointDiskFullError) as caught:
        atomic_torch_save({"step": 2, "w": torch.zeros(3 * 2**20 // 4)}, path)  # 3 MiB of tensors
    monkeypatch.undo()
    message = str(caught.value)
    assert f"no space left on the device while writing the checkpoint {path}: it needs about 3.0 MiB" in message
    assert f"MiB are free in {tmp_path}" in message
    assert torch.load(path, weights_only=True)["step"] == 1  # the previous one, whole
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no partial file


def test_disk_full_reads_the_exception_chain():
    with open(os.devnull, "wb") as f, pytest.raises(RuntimeError) as caught:
        full_disk_save(None, f)
    assert disk_full(caught.value)
    assert disk_full(OSError(errno.ENOSPC, "full")) and not disk_full(OSError(errno.EACCES, "denied"))
    assert not disk_full(RuntimeError("unexpected pos"))


def test_check_writable(tmp_path, monkeypatch):
    check_writable(tmp_path / "not" / "yet" / "there", "checkpoint.dirpath")  # created later, under a writable one
    assert list(tmp_path.iterdir()) == []  # nothing left behind
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=rf"checkpoint.dirpath: {blocker}/ckpts is not writable \({blocker} is not a "
                                          "directory\\)"):
        check_writable(blocker / "ckpts", "checkpoint.dirpath")

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("tempfile.mkstemp", denied)
    with pytest.raises(ConfigError, match=rf"trainer.logger.save_dir: {tmp_path} is not writable \(cannot create a "
                                          rf"file in {tmp_path}: Permission denied\)"):
        check_writable(tmp_path, "trainer.logger.save_dir")


def test_last_link_is_replaced_without_a_moment_without_it(tmp_path, monkeypatch):
    """Lightning removes ``last.ckpt`` and then links it anew: a kill between the two leaves no ``last.ckpt``.
    rlflow renames a new link over the old one."""
    old, new = tmp_path / "epoch=0-step=1.ckpt", tmp_path / "epoch=0-step=2.ckpt"
    old.write_text("1")
    new.write_text("2")
    link = tmp_path / "last.ckpt"
    link.symlink_to(old.name)
    trainer = SimpleNamespace(is_global_zero=True, strategy=SimpleNamespace(barrier=lambda: None))

    def no_remove(path, *args, **kwargs):
        raise AssertionError(f"removed {path}")

    monkeypatch.setattr(os, "remove", no_remove)
    RLFlowCheckpoint._link_checkpoint(trainer, str(new), str(link))
    assert link.is_symlink() and os.readlink(link) == new.name and link.read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([old.name, new.name, link.name])
