"""What a data path names: a local path, a local folder with ``?split=``, or a hub dataset in the local cache.

The forms, in the order they are tried:

* a local file, folder or glob that exists is read as that path, whatever its name looks like
  (``openai/gsm8k`` as a folder, a file with ``?`` in its name);
* ``hf://OWNER/NAME?config=CONFIG&split=SPLIT`` is a Hugging Face hub dataset, read as
  ``datasets.load_dataset("OWNER/NAME", "CONFIG", split="SPLIT")`` would read it, but from the local ``datasets``
  cache only (``HF_DATASETS_CACHE``, by default ``~/.cache/huggingface/datasets``): rlflow never downloads.
  ``hf://datasets/OWNER/NAME`` (the ``datasets`` library's own spelling) is the same dataset. Both options are
  optional: a dataset with one cached configuration needs no ``config``, one with one split no ``split``;
  ``split`` also takes ``datasets``' slices (``train[:1000]``);
* ``PATH?split=SPLIT`` picks a split of a ``DatasetDict.save_to_disk`` folder (``PATH/SPLIT`` is the same) or
  the shards of one split in a folder of hub shards (``train-00000-of-00002.parquet``...).

A hub dataset missing from the cache is one :class:`~rlflow.data.dataset.DataError` line saying how to download
it; ``huggingface-cli download`` is not enough, since ``datasets`` reads a hub dataset offline only from the Arrow
files it prepared when it loaded the dataset once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from rlflow.data.dataset import DataError

HUB = "hf://"
OPTIONS = ("config", "split")
QUERY = re.compile(r"^[A-Za-z_]+=[^&]*(?:&[A-Za-z_]+=[^&]*)*$")
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(?:/[A-Za-z0-9][\w.-]*)?$")
_OFFLINE_LOCK = threading.Lock()


@dataclass(frozen=True)
class Location:
    """A data path taken apart: ``path`` (a local path or glob, or a hub repo id when ``hub``) and its options."""

    text: str
    path: str
    hub: bool = False
    config: str | None = None
    split: str | None = None

    @property
    def name(self) -> str:
        """The last part of ``path`` (``gsm8k`` of the hub id ``openai/gsm8k``)."""
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def with_split(self, split: str) -> str:
        """This location as a data path naming ``split`` (for messages)."""
        options = [f"config={self.config}"] if self.config else []
        return f"{HUB if self.hub else ''}{self.path}?{'&'.join([*options, f'split={split}'])}"


def parse_location(text: str) -> Location:
    """Take a data path apart (see the module's docstring); a DataError for an option or a hub id it cannot be."""
    if _exists(text):  # a local path that exists always wins
        return Location(text, text)
    base, mark, query = text.rpartition("?")
    if not mark or not QUERY.match(query):
        base, query = text, ""
    options: dict[str, str] = {}
    for key, value in (part.split("=", 1) for part in query.split("&") if query):
        value = unquote(value)  # percent-escapes only: a '+' stays (datasets' train+test)
        if key not in OPTIONS:
            raise DataError(f"{text}: unknown option {key!r} after '?'; a data path takes {' and '.join(OPTIONS)} "
                            "(hf://openai/gsm8k?config=main&split=train)")
        if key in options or not value:
            raise DataError(f"{text}: option {key!r} is {'given twice' if key in options else 'empty'}")
        options[key] = value
    if not base.startswith(HUB):
        if "config" in options:
            raise DataError(f"{text}: config= names a configuration of a hub dataset (hf://OWNER/NAME?config=...); "
                            "for a local folder, point the path at the configuration's folder")
        return Location(text, base, split=options.get("split"))
    repo = base[len(HUB):].removeprefix("datasets/").strip("/")
    if not REPO_ID.match(repo):
        raise DataError(f"{text}: a hub dataset is written hf://OWNER/NAME with options after '?', e.g. "
                        "hf://openai/gsm8k?config=main&split=train")
    return Location(text, repo, hub=True, config=options.get("config"), split=options.get("split"))


def _exists(text: str) -> bool:
    try:
        return Path(text).expanduser().exists()
    except (OSError, RuntimeError):  # a name too long for the file system, a ~user that does not exist
        return False


def looks_like_hub_id(text: str) -> bool:
    """Whether a local path that does not exist reads like a hub id (``openai/gsm8k``: no suffix, and no local
    folder ``openai`` either), for a hint."""
    return bool(REPO_ID.match(text)) and "/" in text and not Path(text).suffix and not _exists(text.split("/")[0])


# ------------------------------------------------------------------------------------------------ local saves
def saved_dict_split(folder: Path, location: Location) -> Path:
    """The folder of one split of a ``DatasetDict.save_to_disk`` folder: ``location.split``, or its only split."""
    splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
    if location.split is None:
        if len(splits) == 1:
            return folder / splits[0]
        first = splits[0] if splits else "train"
        raise DataError(f"{folder}: a saved datasets.DatasetDict with splits {', '.join(splits)}; point the path at "
                        f"one split: {location.with_split(first)} (or {folder / first})")
    if location.split not in splits:
        raise DataError(f"{location.text}: no split {location.split!r} in this saved datasets.DatasetDict; its splits "
                        f"are {', '.join(splits) or 'none'}")
    return folder / location.split


# ------------------------------------------------------------------------------------------------ the hub
def cache_dir() -> Path:
    """The ``datasets`` cache that hub datasets are read from (``HF_DATASETS_CACHE``)."""
    import datasets

    return Path(str(datasets.config.HF_DATASETS_CACHE)).expanduser()


def cached_configs(repo: str, cache: Path) -> list[str]:
    """The configurations of hub dataset ``repo`` that ``datasets`` has prepared in ``cache``, by the layout its
    offline loader reads: ``<owner>___<name>/<config>/<version>/<commit>/dataset_info.json``."""
    from datasets.naming import camelcase_to_snakecase

    parts = repo.split("/")
    parts[-1] = camelcase_to_snakecase(parts[-1])
    root = cache / "___".join(parts)
    return sorted({p.parts[-4] for p in root.glob("*/*/*/dataset_info.json")})


def download_hint(location: Location) -> str:
    """The one-liner that puts ``location``'s dataset in the ``datasets`` cache (run once, online)."""
    call = "python -c \"from datasets import load_dataset; load_dataset({})\""
    if location.config:
        return call.format(f"{location.path!r}, {location.config!r}")
    return (f"{call.format(repr(location.path))} (for a dataset with several configurations, name one: "
            f"load_dataset({location.path!r}, 'CONFIG'))")


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """``datasets`` in offline mode and quiet while inside: a cached hub dataset is read without any request to the
    hub (its "couldn't be found on the Hub, using the cache" warnings are expected then)."""
    import datasets

    names = [n for n in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if hasattr(datasets.config, n)]
    quiet = logging.getLogger("datasets")
    with _OFFLINE_LOCK:
        saved = {n: getattr(datasets.config, n) for n in names}
        level = quiet.level
        try:
            for n in names:
                setattr(datasets.config, n, True)
            quiet.setLevel(logging.ERROR)
            yield
        finally:
            for n, value in saved.items():
                setattr(datasets.config, n, value)
            quiet.setLevel(level)


def load_hub(location: Location) -> Any:
    """The ``datasets.Dataset`` of a hub location, from the local cache only; one DataError line when it is not
    there (with the command that downloads it) or when its configuration or split is ambiguous or unknown."""
    cache = cache_dir()
    configs = cached_configs(location.path, cache)
    if not configs or (location.config is not None and location.config not in configs):
        cached = f" (cached configurations: {', '.join(configs)})" if configs else ""
        raise DataError(f"{location.text}: not in the local datasets cache {cache}{cached}; rlflow reads hub datasets "
                        f"from the cache only: download it once, online, with {download_hint(location)}")
    if location.config is None and len(configs) > 1:
        raise DataError(f"{location.text}: several configurations of {location.path} are cached ({', '.join(configs)})"
                        f"; name one: {HUB}{location.path}?config={configs[0]}")
    if _exists(location.path):  # datasets.load_dataset would read that folder instead of the cached dataset
        raise DataError(f"{location.text}: a local folder {location.path} hides the hub dataset from datasets; run "
                        "from another directory, or give the folder's path to read it")
    located = Location(location.text, location.path, True, location.config or configs[0], location.split)
    splits = _load_cached(located, cache, None)
    if located.split in splits:
        return splits[located.split]
    if located.split is not None and not re.fullmatch(r"[\w.-]+", located.split):
        # a slice (train[:100]) or a sum of splits (train+test): datasets reads it
        return _load_cached(located, cache, located.split, known=list(splits))
    if located.split is not None:
        raise DataError(f"{location.text}: no split {located.split!r} in {location.path} ({located.config}); its "
                        f"splits are {', '.join(splits)}")
    if len(splits) != 1:
        raise DataError(f"{location.text}: {location.path} ({located.config}) has splits {', '.join(splits)}; name "
                        f"one: {located.with_split(next(iter(splits)))}")
    return next(iter(splits.values()))


def _load_cached(location: Location, cache: Path, split: str | None, known: list[str] | None = None) -> Any:
    """``datasets.load_dataset`` of a cached hub dataset, offline; its failure as one DataError line."""
    import datasets

    try:
        with offline():
            return datasets.load_dataset(location.path, location.config, split=split)
    except Exception as exc:  # any failure of a third-party reader is reported, not a traceback
        reason = (str(exc).splitlines() or [""])[0]
        splits = f"; its splits are {', '.join(known)}" if known else ""
        raise DataError(f"{location.text}: cannot read it from the datasets cache {cache}: {type(exc).__name__}: "
                        f"{reason}{splits}") from exc
