"""Data sources: what ``data.train_data_path`` / ``data.eval_data_path`` name, and reading them in any layout.

A source is a path (or a ``{path, weight, max_prompt_length, judgers, name, ...}`` mapping, see
:class:`DataSource`). The path may be a jsonl or JSON file, a parquet / arrow / csv file, a glob, a directory of
shards (the hub's ``main/train-00000-of-00001.parquet`` layout), a ``datasets.save_to_disk`` directory (a
``DatasetDict``'s split picked with ``?split=``) or a hub dataset in the local cache,
``hf://openai/gsm8k?config=main&split=train`` (:mod:`rlflow.data.locations`).

jsonl and JSON are read by rlflow itself, line by line, so every error names ``file:line`` and the field (what
``datasets``' JSON loader cannot do) and memory stays flat for large files. Columnar files go through Hugging
Face ``datasets`` in streaming mode (no Arrow cache copy of a large file; rows named ``file:row N``); a saved
``datasets`` directory is memory-mapped with ``load_from_disk``, a cached hub dataset with ``load_dataset``.
Simplification: a source is read whole into memory as prompt records for the seeded sampler; streaming bounds the
reading, not the record list.

Judging per source lives in :mod:`rlflow.judgers.panel`.
"""

from __future__ import annotations

import glob
import json
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from rlflow.config_error import ConfigError
from rlflow.data.dataset import (
    BOM,
    DataError,
    PromptFormat,
    PromptRecord,
    check_row,
    collect,
    iter_jsonl,
    json_error,
    load_json,
)
from rlflow.data.locations import Location, load_hub, looks_like_hub_id, parse_location, saved_dict_split
from rlflow.demo.builds import missing_hint
from rlflow.log import warn

COLUMNAR = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
TEXT = (".jsonl", ".json")
DATA_SUFFIXES = ".jsonl, .json, .parquet, .arrow, .csv"
#: Files a hub download or ``save_to_disk`` keeps beside the data, never rows.
METADATA = frozenset({"dataset_infos.json", "dataset_info.json", "state.json", "dataset_dict.json"})
SHARD = re.compile(r"^(?P<split>[A-Za-z0-9_]+)-\d{5}-of-\d{5}")
#: File stems that name a split on their own (``train.jsonl``, ``test.parquet``: tools/convert_gsm8k.py's layout).
SPLIT_STEMS = frozenset({"train", "test", "validation", "valid", "val", "dev", "eval"})


def suffix_of(path: Path) -> str:
    """The data format's suffix of ``path`` (case-insensitive: ``.JSONL`` is ``.jsonl``)."""
    return path.suffix.lower()


def is_data_file(path: Path) -> bool:
    return suffix_of(path) in (*TEXT, *COLUMNAR)


def split_of(path: Path) -> str | None:
    """The split a data file belongs to by its name: a hub shard's (``train-00000-of-00002.parquet``) or a stem
    that is a split's name (``test.jsonl``); None for any other name."""
    match = SHARD.match(path.name)
    if match:
        return match["split"]
    return path.stem.lower() if path.stem.lower() in SPLIT_STEMS else None


@dataclass
class DataSource:
    """One dataset of a (possibly mixed) run, with its share of each batch and its own limits and judgers.

    Args:
        path: A jsonl/JSON/parquet/arrow/csv file, a glob, a directory of shards, a ``datasets.save_to_disk`` dir
            (``dir?split=train`` for one split of a ``DatasetDict``), or a hub dataset in the local ``datasets``
            cache, ``hf://OWNER/NAME?config=CONFIG&split=SPLIT``.
        weight: Relative share of the prompts of every rollout step (weights are normalised over the sources).
        max_prompt_length: Prompts longer than this many tokens are dropped; None uses ``data.max_prompt_length``.
        judgers: This source's judgers, replacing ``data.judging.judgers`` for its rows: a judger spec (short name,
            ``class_path`` mapping or list) for every row, or a ``{data_source: spec}`` routing like
            ``data.judging.judgers``.
        name: Name in logs and metrics; defaults to the file or directory name.
        system_prompt: Overrides ``data.prompts.system_prompt`` for this source's chat prompts.
        prompt_template: Overrides ``data.prompts.template`` for this source's plain-string prompts.
    """

    path: str
    weight: float = 1.0
    max_prompt_length: int | None = None
    judgers: Any = None
    name: str | None = None
    system_prompt: str | None = None
    prompt_template: str | None = None
    key: str = field(default="", init=False, repr=False, compare=False)
    """The setting the source was given in (``data.train_data_path[1]``), named by errors about its path."""

    def judger_routes(self) -> dict[str, Any] | None:
        """This source's judgers as a ``{data_source: spec}`` routing (a bare spec becomes ``{"*": spec}``)."""
        if self.judgers is None:
            return None
        if isinstance(self.judgers, dict) and "class_path" not in self.judgers:
            return dict(self.judgers)
        return {"*": self.judgers}


def _default_name(location: Location) -> str:
    if location.hub:
        return location.name
    path = location.path
    p = Path(path.split("*")[0].rstrip("/") or path)
    return p.stem if p.suffix in (*TEXT, *COLUMNAR) else (p.name or str(p))


def parse_sources(spec: Any, what: str = "data.train_data_path") -> list[DataSource]:
    """Turn a config value (a path, a mapping, a :class:`DataSource`, or a list of them) into sources."""
    if spec is None:
        return []
    items = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    allowed = [f.name for f in fields(DataSource) if f.init]
    sources = []
    given: dict[str, str] = {}  # a name the config gives -> the source that has it
    for i, item in enumerate(items):
        where = f"{what}[{i}]" if isinstance(spec, (list, tuple)) else what
        if isinstance(item, DataSource):
            source = item
        elif isinstance(item, (str, Path)):
            source = DataSource(path=str(item))
        elif isinstance(item, dict):
            unknown = sorted(set(item) - set(allowed))
            if unknown or "path" not in item:
                problem = f"unknown key(s) {', '.join(unknown)}" if unknown else "no 'path'"
                glued = next((key for key in unknown if ":" in str(key) and item[key] is None), None)
                hint = (f" (YAML reads {{{glued}}} as one key: write {{{str(glued).replace(':', ': ', 1)}}}, a space "
                        "after the colon)") if glued else ""
                raise ConfigError(f"{where}: {problem}; a source takes {', '.join(allowed)}{hint}")
            for key in ("path", "name", "system_prompt", "prompt_template"):
                if key in item and item[key] is not None and not isinstance(item[key], str):
                    raise ConfigError(f"{where}.{key} must be a string, got {type(item[key]).__name__} {item[key]!r}")
            if item["path"] is None:
                raise ConfigError(f"{where}.path is empty")
            source = DataSource(**item)
        else:
            raise ConfigError(f"{where}: a source is a path or a mapping with 'path', got {type(item).__name__}")
        weight = source.weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
            raise ConfigError(f"{where}.weight must be a positive number, got {source.weight!r}")
        limit = source.max_prompt_length
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ConfigError(f"{where}.max_prompt_length must be a whole number >= 1, got {limit!r}")
        if source.prompt_template is not None:
            try:
                PromptFormat(prompt_template=source.prompt_template)
            except ValueError as exc:
                raise ConfigError(f"{where}.{exc}") from exc
        try:
            location = parse_location(source.path)
        except DataError as exc:
            raise ConfigError(f"{where}: {exc}") from exc
        if source.name and source.name in given:
            raise ConfigError(f"{where}.name: {source.name!r} is also the name of {given[source.name]}; each source "
                             "needs a name of its own (its share and metrics are logged under it)")
        if source.name:
            given[source.name] = where
        source.name = source.name or _default_name(location)
        source.key = where
        sources.append(source)
    names = [s.name for s in sources]
    for name in set(names):  # two train.jsonl from different folders: tell them apart (a given name stays)
        if names.count(name) > 1:
            for j, s in enumerate(x for x in sources if x.name == name and x.key not in given.values()):
                s.name = f"{name}.{j}"
    paths = [str(Path(s.path).expanduser().resolve()) if "://" not in s.path else s.path for s in sources]
    for path in sorted({p for p in paths if paths.count(p) > 1}):  # allowed (a weight of 2), but rarely meant
        warn(f"{what}: {path} is listed {paths.count(path)} times; each is read as a source of its own (a larger "
             "weight gives one source a larger share)")
    taken = [s.name for s in sources]
    clash = next((n for n in taken if taken.count(n) > 1), None)
    if clash is not None:  # a numbered name that a source was given: the sources' shares would mix
        raise ConfigError(f"{what}: two sources are named {clash!r}; give them names of their own (name: ...)")
    return sources


# ------------------------------------------------------------------------------------------------ reading
def resolve(path: str | Path | Location) -> tuple[str, list[Path]]:
    """Classify a local data path: ``("saved", [dir])`` for a ``datasets`` save (the split's folder of a
    ``DatasetDict``), else ``("files", [data files...])``; ``?split=`` picks a split (:mod:`rlflow.data.locations`)."""
    location = path if isinstance(path, Location) else parse_location(str(path))
    text, split = location.path, location.split
    if location.hub:
        raise DataError(f"{location.text}: a hub dataset, not a local path (rlflow.data.locations.load_hub reads it)")
    p = Path(text).expanduser()
    if any(ch in text for ch in "*?[") and not p.exists():
        if split is not None:
            raise DataError(f"{location.text}: split= picks a split of a folder or a hub dataset; a glob names its "
                            f"files itself (e.g. {text.rsplit('/', 1)[0]}/{split}-*)")
        matched = [Path(p) for p in sorted(glob.glob(text, recursive=True)) if Path(p).is_file()]
        files = [f for f in matched if is_data_file(f) and f.name not in METADATA]  # a README beside them: skipped
        if not files:
            raise DataError(f"{text}: no {'data ' if matched else ''}file matches this pattern"
                            + (f" ({DATA_SUFFIXES}; it matches {matched[0].name})" if matched else ""))
        return "files", files
    if not p.exists():
        hint = f"; a hub dataset is written hf://{text}" if looks_like_hub_id(text) else missing_hint(text)
        raise DataError(f"{p}: data file not found{hint}")
    if p.is_file():
        if not is_data_file(p):
            raise DataError(f"{p}: not a data file ({DATA_SUFFIXES}, by its name)")
        if split is not None:
            raise DataError(f"{location.text}: split= picks a split of a saved DatasetDict, a folder of shards or "
                            f"a hub dataset; {p} is a file")
        return "files", [p]
    if (p / "dataset_dict.json").is_file():
        return "saved", [saved_dict_split(p, location)]
    if (p / "state.json").is_file() and (p / "dataset_info.json").is_file():
        if split is not None:
            raise DataError(f"{location.text}: {p} is a saved datasets.Dataset, which has no splits; "
                            f"drop ?split={split}")
        return "saved", [p]
    return "files", _shards(p, location)


def _shards(p: Path, location: Location) -> list[Path]:
    """The data files under folder ``p``: those of ``location.split`` if given, else all of one split."""
    files = sorted(  # hidden entries skipped: huggingface-cli keeps its own metadata under .cache/
        f for f in p.rglob("*")
        if f.is_file() and is_data_file(f) and f.name not in METADATA
        and not any(part.startswith(".") for part in f.relative_to(p).parts)
    )
    if not files:
        present = ", ".join(sorted(f.name for f in p.iterdir())[:10]) or "nothing"
        raise DataError(
            f"{p}: no data files ({DATA_SUFFIXES}) in this directory; it holds {present}"
        )
    splits = sorted({split for f in files if (split := split_of(f)) is not None})
    if location.split is not None:
        files = [f for f in files if split_of(f) == location.split]
        if not files:
            raise DataError(f"{location.text}: no files of split {location.split!r} in {p} (named "
                            f"{location.split}-00000-of-0000N.parquet or {location.split}.jsonl); its files are of "
                            f"{', '.join(splits) or 'no split'}")
        return files
    if len(splits) > 1:
        split = "train" if "train" in splits else splits[-1]
        raise DataError(f"{p}: holds files of several splits ({', '.join(splits)}); name one with a glob, e.g. "
                        f"{p}/**/{split}*{files[0].suffix}, or as {location.with_split(split)}")
    return files


def _iter_json_array(path: Path) -> Iterator[tuple[str, PromptRecord | DataError]]:
    text = path.read_bytes().removeprefix(BOM.encode())
    first = text.lstrip()[:1]
    if first == b"{" and b"\n" in text.strip() and not text.lstrip().splitlines()[0].rstrip().endswith(b"}"):
        raise DataError(f"{path}: holds one JSON object over several lines; rlflow reads a JSON array of rows "
                        "([{...}, {...}]) or JSON lines (one object per line)")
    if first != b"[":
        yield from iter_jsonl(path)  # JSON lines under a .json name
        return
    try:
        rows = load_json(text.decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{exc.lineno}: {json_error(exc)}") from exc
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text: {exc}") from exc
    yield from _iter_rows(rows, str(path))


def _iter_rows(rows: Any, name: str) -> Iterator[tuple[str, PromptRecord | DataError]]:
    try:
        for i, row in enumerate(rows, start=1):
            where = f"{name}:row {i}"
            try:
                yield where, check_row(row, where)
            except DataError as exc:
                yield where, exc
    except DataError:
        raise
    except Exception as exc:  # a corrupt shard, a schema clash between shards: name the file
        raise DataError(f"{name}: cannot read rows: {type(exc).__name__}: {exc}") from exc


def _iter_columnar(path: Path, streaming: bool) -> Iterator[tuple[str, PromptRecord | DataError]]:
    from datasets import load_dataset

    try:
        rows = load_dataset(COLUMNAR[suffix_of(path)], data_files=[str(path)], split="train", streaming=streaming)
    except Exception as exc:
        raise DataError(f"{path}: cannot read it as {COLUMNAR[suffix_of(path)]}: {type(exc).__name__}: {exc}") \
            from exc
    yield from _iter_rows(rows, str(path))


def iter_records(
    path: str | Path, streaming: bool = True, key: str = ""
) -> Iterator[tuple[str, PromptRecord | DataError]]:
    """Every row of a source path: ``(where, record)`` or ``(where, DataError)``, ``where`` being file:line/row.

    Args:
        path: Anything :class:`DataSource` accepts as ``path``.
        streaming: Read columnar files through ``datasets`` without building its Arrow cache (False builds it,
            which makes later runs over the same file faster to open).
        key: The setting that gave the path (``data.train_data_path``); an error about the path itself (not found,
            not cached, no such split) starts with it.
    """
    try:
        location = parse_location(str(path))
        if location.hub:
            rows, name = load_hub(location), location.text
        else:
            kind, files = resolve(location)
            rows, name = (_load_saved(files[0]), str(files[0])) if kind == "saved" else (None, "")
    except DataError as exc:
        if not key:
            raise
        raise DataError(f"{key}: {exc}") from exc
    if rows is not None:
        yield from _iter_rows(rows, name)
        return
    for f in files:
        if suffix_of(f) == ".jsonl":
            yield from iter_jsonl(f)
        elif suffix_of(f) == ".json":
            yield from _iter_json_array(f)
        else:
            yield from _iter_columnar(f, streaming)


def _load_saved(folder: Path) -> Any:
    from datasets import load_from_disk

    try:
        return load_from_disk(str(folder))
    except Exception as exc:  # any failure of a third-party reader is reported, not a traceback
        raise DataError(f"{folder}: cannot load the saved dataset: {type(exc).__name__}: {exc}") from exc


def read_source(source: DataSource | str, streaming: bool = True) -> list[PromptRecord]:
    """All records of a source, each tagged with the source's name; one DataError lists the bad rows."""
    source = source if isinstance(source, DataSource) else parse_sources(source)[0]
    records = collect(source.path, iter_records(source.path, streaming, source.key))
    for record in records:
        record.origin = source.name or ""
    return records


# ------------------------------------------------------------------------------------------------ judging
def per_source_means(keys: Sequence[str | None], values: Sequence[float], prefix: str = "reward") -> dict[str, float]:
    """``{f"{prefix}/{key}": mean of values with that key}`` (``reward/openai/gsm8k``...); None keys are skipped."""
    sums: dict[str, list[float]] = {}
    for key, value in zip(keys, values):
        if key is not None:
            sums.setdefault(str(key), []).append(float(value))
    return {f"{prefix}/{key}": sum(v) / len(v) for key, v in sums.items()}
