"""Checkpoints read with ``weights_only=True`` only: a URL serving a pickle payload from 127.0.0.1 runs no code, in
:class:`SafeCheckpointIO` and through Lightning's own ``fit(ckpt_path=...)``; a local one neither; good checkpoints
read, from a URL afresh each time."""

from __future__ import annotations

import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from rlflow.config_error import ConfigError
from rlflow.training.safe_load import SafeCheckpointIO, load_checkpoint


class Payload:
    """Unpickled, it creates the file ``marker``: the stand-in for code a crafted checkpoint runs."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def checkpoint_bytes(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.fixture
def served():
    """Serves ``files[path]`` on 127.0.0.1 (404 for any other path); yields ``(base url, files)``."""
    files: dict[str, bytes] = {}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = files.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Length", str(len(body or b"")))
            self.end_headers()
            self.wfile.write(body or b"")

        do_HEAD = do_GET

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", files
    httpd.shutdown()
    httpd.server_close()


def test_a_url_serving_a_pickle_payload_runs_no_code(served, tmp_path):
    base, files = served
    marker = tmp_path / "ran"
    files["/last.ckpt"] = checkpoint_bytes({"state_dict": {"w": torch.ones(2)}, "payload": Payload(str(marker))})
    with pytest.raises(ConfigError) as refused:
        SafeCheckpointIO().load_checkpoint(f"{base}/last.ckpt", weights_only=False)  # asked for: not honoured
    message = str(refused.value)
    assert not marker.exists(), "the checkpoint's payload ran"
    assert "\n" not in message and message.startswith(f"--ckpt_path {base}/last.ckpt: the checkpoint holds more")
    assert "weights_only=True" in message and "open" in message  # what it tried to load


def test_lightning_fit_with_a_url_ckpt_path_runs_no_code(served, tmp_path):
    base, files = served
    marker = tmp_path / "ran"
    files["/last.ckpt"] = checkpoint_bytes({"state_dict": {}, "payload": Payload(str(marker))})
    trainer = L.Trainer(plugins=[SafeCheckpointIO()], max_steps=1, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path)
    with pytest.raises(ConfigError, match="will not unpickle it"):
        trainer.fit(BoringModel(), ckpt_path=f"{base}/last.ckpt")
    assert not marker.exists()


def test_a_local_checkpoint_with_a_payload_is_refused_too(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "last.ckpt"
    path.write_bytes(checkpoint_bytes({"payload": Payload(str(marker))}))
    with pytest.raises(ConfigError, match="will not unpickle it"):
        load_checkpoint(path)
    assert not marker.exists()


def test_good_checkpoints_read_and_a_url_is_fetched_afresh_each_time(served, tmp_path):
    base, files = served
    for value in (1.0, 2.0):  # the same URL, new contents: no cache answers for it
        files["/last.ckpt"] = checkpoint_bytes({"state_dict": {"w": torch.full((2,), value)}, "global_step": 3,
                                                "rng": {"python": (3, (1, 2), None)}})
        loaded = SafeCheckpointIO().load_checkpoint(f"{base}/last.ckpt")
        assert torch.equal(loaded["state_dict"]["w"], torch.full((2,), value)) and loaded["global_step"] == 3
    local = tmp_path / "last.ckpt"
    local.write_bytes(files["/last.ckpt"])
    assert load_checkpoint(local)["global_step"] == 3
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "none.ckpt")


def test_a_url_that_cannot_be_fetched_is_one_line(served):
    base, _ = served
    with pytest.raises(ConfigError) as missing:
        load_checkpoint(f"{base}/missing.ckpt")
    assert "\n" not in str(missing.value) and "cannot download the checkpoint" in str(missing.value)
    assert "404" in str(missing.value) or "Not Found" in str(missing.value)


@pytest.mark.parametrize("checkpointing", [True, False])
def test_the_trainer_rlflow_fit_builds_never_unpickles_a_url(served, tmp_path, tiny_model, tiny_data, checkpointing):
    """``rlflow fit --ckpt_path URL``: the strategy's checkpoint IO is the atomic writer (a SafeCheckpointIO) with
    rlflow's checkpoint callback, and SafeCheckpointIO without it; a payload served at the URL runs nowhere."""
    from rlflow.cli import cli_main
    from rlflow.training.checkpointing import AtomicCheckpointIO
    from tests.helpers.fit import fit_args

    base, files = served
    marker = tmp_path / "ran"
    files["/last.ckpt"] = checkpoint_bytes({"state_dict": {}, "payload": Payload(str(marker))})
    args = fit_args(tiny_model, tiny_data, tmp_path, f"--trainer.enable_checkpointing={str(checkpointing).lower()}")
    cli = cli_main(args[1:], run=False)
    io = cli.trainer.strategy.checkpoint_io
    assert isinstance(io, SafeCheckpointIO)
    if checkpointing:  # RLFlowCheckpoint puts its atomic writer in at setup: it reads safely too
        assert issubclass(AtomicCheckpointIO, SafeCheckpointIO)
    with pytest.raises(ConfigError, match="will not unpickle it"):
        io.load_checkpoint(f"{base}/last.ckpt")
    with pytest.raises(ConfigError, match="will not unpickle it"):
        AtomicCheckpointIO().load_checkpoint(f"{base}/last.ckpt")
    assert not marker.exists()
