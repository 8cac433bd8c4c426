"""Checkpoint folders (FSDP2's distributed checkpoints) written atomically: a new folder swapped in whole, a failed
write that leaves the old one as it was, a deletion that never leaves half a folder, and the clean-up after a
kill."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlflow.training import checkpointing
from rlflow.training.checkpointing import (
    AtomicCheckpointIO,
    remove_stale_partials,
    replace_folder,
    save_folder_atomically,
)


def folder(path: Path, **files: str) -> Path:
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)
    return path


def contents(path: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(path.iterdir())}


class OneRank:
    """The part of a Lightning strategy that :func:`save_folder_atomically` uses, for one process."""

    is_global_zero = True

    def broadcast(self, obj, src=0):
        return obj

    def barrier(self, *args):
        pass


def dead_pid() -> int:
    """The id of a process that has exited."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


@pytest.mark.parametrize("swap", [True, False], ids=["exchange", "two-renames"])
def test_a_new_folder_replaces_the_old_one_whole(tmp_path, monkeypatch, swap):
    probe = [tmp_path / "a", tmp_path / "b"]
    for p in probe:
        p.touch()
    if swap and not checkpointing._exchange(*probe):
        pytest.skip(f"the file system of {tmp_path} swaps no two names in one step")
    for p in probe:
        p.unlink()
    swaps = []
    exchange = checkpointing._exchange if swap else (lambda a, b: False)  # False: no atomic swap on this system
    monkeypatch.setattr(checkpointing, "_exchange", lambda a, b: swaps.append(exchange(a, b)) or swaps[-1])
    last = folder(tmp_path / "last.ckpt", **{"meta.pt": "1", "__0_0.distcp": "one"})
    new = folder(tmp_path / ".partial-1-0123abcd.tmp", **{"meta.pt": "2", "__0_0.distcp": "two"})
    replace_folder(new, last)
    assert contents(last) == {"__0_0.distcp": "two", "meta.pt": "2"}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    assert swaps == [swap]
    first = folder(tmp_path / ".partial-1-0123abce.tmp", x="3")  # nothing under the name yet
    replace_folder(first, tmp_path / "epoch=0-step=1.ckpt")
    assert contents(tmp_path / "epoch=0-step=1.ckpt") == {"x": "3"}


def test_a_failed_write_leaves_the_previous_folder_as_it_was(tmp_path):
    last = folder(tmp_path / "last.ckpt", **{"meta.pt": "1", "__0_0.distcp": "one"})

    def torn(new: Path) -> None:
        folder(new, **{"__0_0.distcp": "half a sh"})
        raise KeyboardInterrupt  # (a BaseException, as a signal's is)

    with pytest.raises(KeyboardInterrupt):
        save_folder_atomically(OneRank(), last, torn)
    assert contents(last) == {"__0_0.distcp": "one", "meta.pt": "1"}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # the partial folder is gone
    save_folder_atomically(OneRank(), last, lambda new: folder(new, **{"meta.pt": "2"}))
    assert contents(last) == {"meta.pt": "2"}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_a_kill_between_the_two_renames_is_repaired_by_the_next_run(tmp_path, monkeypatch):
    """Without an atomic swap the old folder is renamed aside first: a kill before the new one takes its name
    leaves no ``last.ckpt``; the next run's clean-up puts the old one back (and removes the written partial)."""
    monkeypatch.setattr(checkpointing, "_exchange", lambda a, b: False)
    last = folder(tmp_path / "last.ckpt", **{"meta.pt": "1"})
    new = folder(checkpointing._partial(tmp_path), **{"meta.pt": "2"})
    real_rename, renames = os.rename, []

    def rename(src, dst):
        if renames:
            raise KeyboardInterrupt  # killed after the first rename
        renames.append((src, dst))
        real_rename(src, dst)

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(os, "rename", rename)
        replace_folder(new, last)
    assert not last.exists() and len(list(tmp_path.glob(".partial-*.aside"))) == 1
    monkeypatch.setattr(checkpointing, "_alive", lambda pid: False)  # the next run: the killed process is gone
    assert remove_stale_partials(tmp_path) == [new]
    assert contents(last) == {"meta.pt": "1"} and [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]


def test_stale_partials_of_folders_are_removed_and_a_live_process_s_are_kept(tmp_path):
    gone = folder(tmp_path / f".partial-{dead_pid()}-0123abcd.tmp", x="half")
    aside = folder(tmp_path / f".partial-{dead_pid()}-0123abce-last.ckpt.aside", x="old")
    folder(tmp_path / "last.ckpt", x="new")  # the aside folder's name is taken: it is not put back
    running = folder(tmp_path / f".partial-{os.getppid()}-0123abcf.tmp", x="being written")
    assert sorted(remove_stale_partials(tmp_path)) == sorted([gone, aside])
    assert running.exists() and contents(tmp_path / "last.ckpt") == {"x": "new"}


def test_removing_a_checkpoint_folder_never_leaves_half_of_it_under_its_name(tmp_path, monkeypatch):
    old = folder(tmp_path / "epoch=0-step=1.ckpt", **{"meta.pt": "1", "__0_0.distcp": "one"})
    seen = []

    def interrupted_rmtree(path, ignore_errors=False):
        seen.append(Path(path))
        (Path(path) / "meta.pt").unlink()
        raise KeyboardInterrupt

    with monkeypatch.context() as patch, pytest.raises(KeyboardInterrupt):
        patch.setattr(checkpointing.shutil, "rmtree", interrupted_rmtree)
        AtomicCheckpointIO().remove_checkpoint(old)
    assert not old.exists() and seen[0].name.startswith(".partial-")  # the half-deleted folder is a partial one
    file = tmp_path / "last.ckpt"
    file.write_text("x")
    AtomicCheckpointIO().remove_checkpoint(file)  # a single-file checkpoint: Lightning's removal
    assert not file.exists()


def test_a_link_replaces_a_last_checkpoint_folder_whole(tmp_path, monkeypatch):
    """``save_last="link"`` where ``last.ckpt`` is a folder (written by ``save_last=True`` before): the new link
    is swapped in, the folder deleted after, so there is never a moment without a ``last.ckpt``."""
    from types import SimpleNamespace

    from rlflow.training.checkpointing import RLFlowCheckpoint

    last = folder(tmp_path / "last.ckpt", **{"meta.pt": "1"})
    step = folder(tmp_path / "epoch=0-step=2.ckpt", **{"meta.pt": "2"})
    trainer = SimpleNamespace(is_global_zero=True, strategy=SimpleNamespace(barrier=lambda: None))
    with monkeypatch.context() as patch:
        patch.setattr(checkpointing.shutil, "rmtree", lambda path, **kw: pytest.fail(f"{path} removed in place"))
        patch.setattr(checkpointing, "_remove", lambda path: removed.append(path.name))
        removed = []
        RLFlowCheckpoint._link_checkpoint(trainer, str(step), str(last))
    assert last.is_symlink() and os.readlink(last) == step.name and contents(last) == {"meta.pt": "2"}
    assert len(removed) == 1 and removed[0].startswith(".partial-")  # the old folder, under a partial name
