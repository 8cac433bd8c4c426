"""The disk: an unwritable checkpoint or log directory stops ``rlflow fit`` at startup with one line naming it; a
disk that fills up while a checkpoint is written (a faked ``ENOSPC`` as torch raises it, and a real 6 MiB tmpfs
where this machine can mount one) ends the run with one line naming the directory and the space needed, and the
checkpoint already there stays whole."""

from __future__ import annotations

import errno
import os
import shlex
import shutil
import subprocess
import sys

import pytest
import torch

from rlflow.cli import main
from tests.helpers.paths import ROOT
from tests.helpers.processes import rlflow_env
from tests.helpers.resume_helpers import run_args

pytestmark = pytest.mark.slow


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("rlflow: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    "option, key",
    [("--checkpoint.dirpath={blocked}/checkpoints", "checkpoint.dirpath"),
     ("--trainer.logger.save_dir={blocked}/logs", "trainer.logger.save_dir")],
    ids=["checkpoints", "logs"],
)
def test_an_unwritable_directory_stops_the_run_at_startup(option, key, tiny_model, small_data, tmp_path, capsys):
    blocked = tmp_path / "a-file"
    blocked.write_text("a file where a directory should be\n")
    code = main([*run_args(tiny_model, small_data, tmp_path, steps=2), option.format(blocked=blocked)])
    line = one_error_line(capsys.readouterr().err)
    assert code == 1 and key in line and str(blocked) in line, line
    assert not list(tmp_path.rglob("metrics.csv")) and not list(tmp_path.rglob("*.ckpt"))  # nothing was trained


def test_a_full_disk_while_checkpointing_is_one_line_and_keeps_the_last_checkpoint(
    tiny_model, small_data, tmp_path, one_thread, monkeypatch, capsys
):
    """The second checkpoint's write fails as torch's zip writer fails on a full disk: a ``RuntimeError`` whose
    context is the file's ``OSError(ENOSPC)``, after part of the file was written."""
    real_save, saves = torch.save, []

    def filling_disk(obj, f, *args, **kwargs):
        if ".partial-" not in str(getattr(f, "name", "")):
            return real_save(obj, f, *args, **kwargs)
        saves.append(f.name)
        if len(saves) < 2:
            return real_save(obj, f, *args, **kwargs)
        f.write(b"PK\x03\x04" + bytes(1000))
        try:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None

    monkeypatch.setattr(torch, "save", filling_disk)
    code = main(run_args(tiny_model, small_data, tmp_path, "--checkpoint.save_top_k=0", steps=3))
    monkeypatch.undo()
    line = one_error_line(capsys.readouterr().err)
    checkpoints = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    assert code == 1 and f"while writing the checkpoint {checkpoints}/last.ckpt: it needs about" in line, line
    assert f"MiB are free in {checkpoints}" in line, line
    assert torch.load(checkpoints / "last.ckpt", weights_only=True)["global_step"] == 1  # whole
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt"]  # no partial file left


def test_a_full_disk_while_logging_is_one_line_naming_the_log_directory(
    tiny_model, small_data, tmp_path, one_thread, monkeypatch, capsys
):
    from lightning.fabric.loggers.csv_logs import _ExperimentWriter

    def full(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(_ExperimentWriter, "save", full)
    code = main(run_args(tiny_model, small_data, tmp_path, steps=2))
    line = one_error_line(capsys.readouterr().err)
    log_dir = tmp_path / "lightning_logs" / "version_0"
    assert code == 1 and f"no space left on the device while writing {log_dir} (" in line, line
    assert f"MiB free in {log_dir})" in line and "--ckpt_path last" in line, line


def can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
                           capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs unshare and tmpfs mounts in a user namespace")
def test_a_real_full_disk(tiny_model, small_data, tmp_path):
    """A 6 MiB tmpfs holds one checkpoint of the tiny model (3.6 MiB) but not a second one beside it."""
    small = tmp_path / "small-disk"
    small.mkdir()
    args = run_args(tiny_model, small_data, tmp_path, f"--checkpoint.dirpath={small}", "--checkpoint.save_top_k=0",
                    steps=3)
    check = f"import torch; print('step', torch.load('{small}/last.ckpt', weights_only=True)['global_step'])"
    script = (f"mount -t tmpfs -o size=6m tmpfs {small} && {sys.executable} -m rlflow {shlex.join(args)}; "
              f"echo rc=$?; {sys.executable} -c \"{check}\"; ls -a {small}")
    env = rlflow_env()
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=400)
    line = one_error_line(proc.stderr)
    assert f"no space left on the device while writing the checkpoint {small}/last.ckpt" in line, line
    assert "it needs about 3.6 MiB" in line and f"free in {small}" in line, line
    assert "rc=1" in proc.stdout and "step 1" in proc.stdout, proc.stdout[-2000:]
    assert proc.stdout.split()[-3:] == [".", "..", "last.ckpt"], proc.stdout[-500:]  # no partial file left
