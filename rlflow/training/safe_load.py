"""Checkpoints are read with ``torch.load(weights_only=True)`` only, from a file or a URL: reading one runs no code.

Lightning reads an ``http(s)://`` ``--ckpt_path`` with ``torch.hub.load_state_dict_from_url(weights_only=False)``:
it unpickles whatever the server sends (a crafted checkpoint runs code as the trainer) and caches the file under
the URL's last path component (``last.ckpt`` of one host answers for ``last.ckpt`` of another).
:class:`SafeCheckpointIO` replaces that read, for every path: a URL, named explicitly, is downloaded to a
temporary file (deleted after the read) and read from there; a local or ``fsspec`` path (``s3://``) is read in
place; always with ``weights_only=True``, whatever ``weights_only`` the caller asks for. rlflow's checkpoints hold
only tensors and plain Python values, so they read this way. A file that needs more (a pickled object, code) is
refused with one line naming it and what it tried to load; a URL that cannot be fetched, likewise.
"""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import urllib.error
import urllib.request
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem

from rlflow.config_error import ConfigError

#: Seconds a checkpoint download may wait for the server between reads.
DOWNLOAD_TIMEOUT = 60.0


def is_url(path: str | os.PathLike) -> bool:
    return str(path).startswith(("http://", "https://"))


def _refusal(path: str | os.PathLike, exc: pickle.UnpicklingError) -> ConfigError:
    reason = next((line.split("WeightsUnpickler error:", 1)[1] for line in str(exc).splitlines()
                   if "WeightsUnpickler error:" in line), str(exc))
    reason = " ".join(reason.split(" Please use")[0].split())[:300]  # not torch's advice to allow it anyway
    return ConfigError(
        f"--ckpt_path {path}: the checkpoint holds more than tensors and plain values ({reason}); rlflow reads "
        "checkpoints with torch.load(weights_only=True) only and will not unpickle it: use a checkpoint written by "
        "rlflow fit, from a source you trust"
    )


def _download(url: str, into: str) -> None:
    """``url`` into the file ``into``; a ConfigError, one line, when it cannot be fetched."""
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT) as response, open(into, "wb") as out:
            shutil.copyfileobj(response, out, 2**20)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", None) or exc
        raise ConfigError(f"--ckpt_path {url}: cannot download the checkpoint: {' '.join(str(reason).split())}") \
            from exc


def load_checkpoint(path: str | os.PathLike, map_location: Any = None) -> dict[str, Any]:
    """The checkpoint at ``path`` (a file, an ``fsspec`` URL or an ``http(s)://`` URL), read with
    ``torch.load(weights_only=True)``; FileNotFoundError where a path names nothing, ConfigError (one line) for a
    checkpoint that needs unpickling or a URL that cannot be fetched."""
    try:
        if is_url(path):
            with tempfile.TemporaryDirectory(prefix="rlflow-ckpt-") as tmp:
                local = os.path.join(tmp, "checkpoint")
                _download(str(path), local)
                return torch.load(local, map_location=map_location, weights_only=True)
        fs = get_filesystem(path)
        if not fs.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        with fs.open(path, "rb") as f:
            return torch.load(f, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _refusal(path, exc) from exc


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` whose reads are :func:`load_checkpoint`: ``weights_only=True`` always, a URL
    downloaded afresh (never unpickled, never cached)."""

    def load_checkpoint(self, path: Any, map_location: Any = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        return load_checkpoint(path, map_location)
