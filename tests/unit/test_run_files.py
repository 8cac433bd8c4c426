"""Without a logger ``fit`` writes its run files into ``trainer.default_root_dir`` (the working directory by
default): never over files another run or the user left there, and never over the run's own ``--config``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rlflow.cli import RUN_FILES, check_run_files
from rlflow.config_error import ConfigError


def trainer(root, loggers=(), rank=0):
    return SimpleNamespace(loggers=list(loggers), global_rank=rank, default_root_dir=str(root))


def test_an_empty_folder_takes_the_run(tmp_path):
    check_run_files(trainer(tmp_path), [], resuming=False)


@pytest.mark.parametrize("name", RUN_FILES)
def test_a_run_file_already_there_is_refused_unless_its_run_is_resumed(tmp_path, name):
    (tmp_path / name).write_text("someone's\n") if "." in name else (tmp_path / name).mkdir()
    with pytest.raises(ConfigError, match=rf"trainer.logger is off.*\({tmp_path}\), which already has {name};"):
        check_run_files(trainer(tmp_path), [], resuming=False)
    check_run_files(trainer(tmp_path), [], resuming=True)


def test_the_runs_own_config_file_is_never_overwritten_even_resuming(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text("trainer: {logger: false}\n")
    for resuming in (False, True):
        with pytest.raises(ConfigError, match=r"config.yaml \(this run's --config"):
            check_run_files(trainer("."), ["config.yaml"], resuming=resuming)
    check_run_files(trainer(tmp_path), [str(tmp_path / "other.yaml")], resuming=True)


def test_with_a_logger_nothing_is_checked_and_without_one_every_rank_stops_alike(tmp_path):
    (tmp_path / "config.yaml").write_text("x: 1\n")
    check_run_files(trainer(tmp_path, loggers=[object()]), [str(tmp_path / "config.yaml")], resuming=False)
    for rank in (0, 1):  # a rank that went on alone would wait for the others forever
        with pytest.raises(ConfigError, match="this run's --config"):
            check_run_files(trainer(tmp_path, rank=rank), [str(tmp_path / "config.yaml")], resuming=False)


def test_fit_refuses_before_loading_anything_and_the_config_file_is_kept(tiny_model, tiny_data, tmp_path,
                                                                         monkeypatch):
    from rlflow.cli import main

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "config.yaml"
    text = (f"# my run\nmodel: {{model_path: {tiny_model}}}\ndata: {{train_data_path: {tiny_data / 'train.jsonl'}}}\n"
            "trainer: {logger: false, max_steps: 1, accelerator: cpu}\n")
    config.write_text(text)
    assert main(["fit", "--config", "config.yaml"]) == 1
    assert config.read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
