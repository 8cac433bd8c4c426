"""Fail fast on a model path that is neither on disk nor loadable from the Hugging Face hub.

``from_pretrained`` treats any ``name/other`` it cannot find on disk as a hub id and, without a network,
retries for about 50 seconds before it fails with a traceback. :func:`check_model_path` decides in well
under 2 seconds, before anything slow is loaded:

1. the path exists on disk (after ``~`` expansion): fine;
2. it is clearly a local path, i.e. absolute, starting with ``.`` or ``~``, with other than exactly one
   ``/`` (hub ids are ``org/name``), or its first component is a local directory (``checkpoints/x`` where
   ``checkpoints/`` exists): a :class:`~rlflow.config_error.ConfigError` naming it and how to build the
   demo model;
3. otherwise it looks like a hub id (``Qwen/Qwen3-8B``): fine if the Hugging Face cache holds it, or if
   the hub answers (a TCP connect to ``HF_ENDPOINT``, by default huggingface.co, within
   :data:`PROBE_SECONDS`), or if an HTTPS proxy is configured (the probe cannot see through it, so
   ``from_pretrained`` decides); an error when ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` is set or the hub
   cannot be reached.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from rlflow.config_error import ConfigError
from rlflow.demo.builds import build_command

PROBE_SECONDS = 1.5
_TRUE = ("1", "true", "yes", "on")
_PROXIES = ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")


def looks_local(path: str) -> bool:
    """Whether ``path`` can only mean a local directory (see rule 2 of the module docstring)."""
    if path.startswith(("/", ".", "~", "\\")) or path.count("/") != 1 or "\\" in path:
        return True
    return Path(path.split("/", 1)[0]).is_dir()


def offline() -> bool:
    """Whether the user told Hugging Face libraries not to use the network."""
    return any(os.environ.get(name, "").strip().lower() in _TRUE for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def in_hf_cache(repo_id: str) -> bool:
    """Whether the local Hugging Face cache already holds ``repo_id`` (its ``config.json`` or tokenizer config)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    for filename in ("config.json", "tokenizer_config.json"):
        try:
            if isinstance(try_to_load_from_cache(repo_id, filename), str):
                return True
        except Exception:  # an id the hub library rejects is simply not cached
            return False
    return False


@functools.cache
def hub_reachable(endpoint: str | None = None, timeout: float = PROBE_SECONDS) -> bool:
    """Whether a TCP connection to the hub's host opens within ``timeout`` seconds (DNS included).

    The connect runs in a daemon thread because name resolution itself has no timeout. Cached per process.
    """
    url = urlparse(endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    result: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=connect, name="rlflow-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def check_model_path(path: str, key: str) -> None:
    """Raise a ConfigError naming ``key`` unless ``path`` is a local directory or a hub id that can be loaded."""
    local = Path(path).expanduser()
    if local.is_dir() and not (local / "config.json").is_file():
        what = ("a PEFT adapter; give its base model here (and the adapter's settings in model.lora)"
                if (local / "adapter_config.json").is_file() else "not a Hugging Face model directory")
        raise ConfigError(f"{key} {path!r} has no config.json: {what}")
    if local.is_file():
        raise ConfigError(f"{key} {path!r} is a file; point it at the model's directory (with config.json)")
    if local.exists():
        return
    command = build_command(path)  # a shipped config's checkpoints/..., which also reads as a hub id
    if command is not None:
        raise ConfigError(f"{key} {path!r} does not exist; build it with '{command}'")
    if looks_local(path):
        raise ConfigError(f"{key} {path!r} does not exist; point it at a Hugging Face model directory (with "
                          "config.json) or a hub id")
    if in_hf_cache(path):
        return
    if offline():
        raise ConfigError(
            f"{key} {path!r} is not a local directory and not in the Hugging Face cache, and HF_HUB_OFFLINE is set; "
            "download the model first, or point it at a local model directory"
        )
    if any(os.environ.get(name) for name in _PROXIES) or hub_reachable():
        return
    raise ConfigError(
        f"{key} {path!r} is not a local directory and the Hugging Face hub cannot be reached to download it; "
        "point it at a local model directory"
    )
