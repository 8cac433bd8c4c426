"""Data sources: what ``data.train_data_path`` / ``data.eval_data_path`` name, and reading them in any layout.

A source is a path (or a ``{path, weight, max_prompt_length, judgers, name, ...}`` mapping, see
:class:`DataSource`). The path may be a jsonl or JSON file, a parquet / arrow / csv file, a glob, a directory of
shards (the hub's ``main/train-00000-of-00001.parquet`` layout) or a ``datasets.save_to_disk`` directory.

jsonl and JSON are read by rlflow itself, line by line, so every error names ``file:line`` and the field (what
``datasets``' JSON loader cannot do) and memory stays flat for large files. Columnar files go through Hugging
Face ``datasets`` in streaming mode (no Arrow cache copy of a large file; rows named ``file:row N``); a saved
``datasets`` directory is memory-mapped with ``load_from_disk``. Simplification: a source is read whole into
memory as prompt records for the seeded sampler; streaming bounds the reading, not the record list.

Judging per source lives in :mod:`rlflow.judgers.panel`.
"""

from __future__ import annotations

import glob
import json
import math
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from rlflow.data.dataset import DataError, PromptFormat, PromptRecord, check_row, collect, iter_jsonl, json_error

COLUMNAR = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv"}
TEXT = (".jsonl", ".json")
SHARD = re.compile(r"^(?P<split>[A-Za-z0-9_]+)-\d{5}-of-\d{5}")


@dataclass
class DataSource:
    """One dataset of a (possibly mixed) run, with its share of each batch and its own limits and judgers.

    Args:
        path: A jsonl/JSON/parquet/arrow/csv file, a glob, a directory of shards, or a ``datasets.save_to_disk`` dir.
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

    def judger_routes(self) -> dict[str, Any] | None:
        """This source's judgers as a ``{data_source: spec}`` routing (a bare spec becomes ``{"*": spec}``)."""
        if self.judgers is None:
            return None
        if isinstance(self.judgers, dict) and "class_path" not in self.judgers:
            return dict(self.judgers)
        return {"*": self.judgers}


def _default_name(path: str) -> str:
    p = Path(path.split("*")[0].rstrip("/") or path)
    return p.stem if p.suffix in (*TEXT, *COLUMNAR) else (p.name or str(p))


def parse_sources(spec: Any, what: str = "data.train_data_path") -> list[DataSource]:
    """Turn a config value (a path, a mapping, a :class:`DataSource`, or a list of them) into sources."""
    if spec is None:
        return []
    items = list(spec) if isinstance(spec, (list, tuple)) else [spec]
    allowed = [f.name for f in fields(DataSource)]
    sources = []
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
                raise ValueError(f"{where}: {problem}; a source takes {', '.join(allowed)}")
            source = DataSource(**{**item, "path": str(item["path"])})
        else:
            raise ValueError(f"{where}: a source is a path or a mapping with 'path', got {type(item).__name__}")
        if not isinstance(source.weight, (int, float)) or not math.isfinite(source.weight) or source.weight <= 0:
            raise ValueError(f"{where}.weight must be a positive number, got {source.weight!r}")
        if source.max_prompt_length is not None and source.max_prompt_length < 1:
            raise ValueError(f"{where}.max_prompt_length must be >= 1, got {source.max_prompt_length}")
        if source.prompt_template is not None:
            try:
                PromptFormat(prompt_template=source.prompt_template)
            except ValueError as exc:
                raise ValueError(f"{where}.{exc}") from exc
        source.name = source.name or _default_name(source.path)
        sources.append(source)
    names = [s.name for s in sources]
    for name in set(names):  # two train.jsonl from different folders: tell them apart
        if names.count(name) > 1:
            for j, s in enumerate(x for x in sources if x.name == name):
                s.name = f"{name}.{j}"
    return sources


# ------------------------------------------------------------------------------------------------ reading
def resolve(path: str | Path) -> tuple[str, list[Path]]:
    """Classify ``path``: ``("saved", [dir])`` for a ``datasets`` save, else ``("files", [data files...])``."""
    text = str(path)
    if any(ch in text for ch in "*?["):
        files = [Path(p) for p in sorted(glob.glob(text, recursive=True)) if Path(p).is_file()]
        if not files:
            raise DataError(f"{text}: no file matches this pattern")
        return "files", files
    p = Path(text).expanduser()
    if not p.exists():
        raise DataError(f"{p}: data file not found")
    if p.is_file():
        return "files", [p]
    if (p / "dataset_dict.json").is_file():
        splits = json.loads((p / "dataset_dict.json").read_text()).get("splits", [])
        raise DataError(
            f"{p}: a saved datasets.DatasetDict with splits {', '.join(splits)}; point the path at one split, "
            f"e.g. {p / (splits[0] if splits else 'train')}"
        )
    if (p / "state.json").is_file() and (p / "dataset_info.json").is_file():
        return "saved", [p]
    files = sorted(  # hidden entries skipped: huggingface-cli keeps its own metadata under .cache/
        f for f in p.rglob("*")
        if f.is_file() and f.suffix in (*TEXT, *COLUMNAR)
        and not any(part.startswith(".") for part in f.relative_to(p).parts)
    )
    if not files:
        present = ", ".join(sorted(f.name for f in p.iterdir())[:10]) or "nothing"
        raise DataError(
            f"{p}: no data files (.jsonl, .json, .parquet, .arrow, .csv) in this directory; it holds {present}"
        )
    splits = sorted({m["split"] for f in files if (m := SHARD.match(f.name))})
    if len(splits) > 1:
        raise DataError(
            f"{p}: holds shards of several splits ({', '.join(splits)}); name one with a glob, "
            f"e.g. {p}/**/{splits[-1] if 'train' not in splits else 'train'}-*{files[0].suffix}"
        )
    return "files", files


def _iter_json_array(path: Path) -> Iterator[tuple[str, PromptRecord | DataError]]:
    text = path.read_bytes()
    if not text.lstrip().startswith(b"["):
        yield from iter_jsonl(path)  # JSON lines under a .json name
        return
    try:
        rows = json.loads(text.decode("utf-8"))
    except json.JSONDecodeError as exc:
        raise DataError(f"{path}:{exc.lineno}: {json_error(exc)}") from exc
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
        rows = load_dataset(COLUMNAR[path.suffix], data_files=[str(path)], split="train", streaming=streaming)
    except Exception as exc:
        raise DataError(f"{path}: cannot read it as {COLUMNAR[path.suffix]}: {type(exc).__name__}: {exc}") from exc
    yield from _iter_rows(rows, str(path))


def iter_records(path: str | Path, streaming: bool = True) -> Iterator[tuple[str, PromptRecord | DataError]]:
    """Every row of a source path: ``(where, record)`` or ``(where, DataError)``, ``where`` being file:line/row.

    Args:
        path: Anything :class:`DataSource` accepts as ``path``.
        streaming: Read columnar files through ``datasets`` without building its Arrow cache (False builds it,
            which makes later runs over the same file faster to open).
    """
    kind, files = resolve(path)
    if kind == "saved":
        from datasets import load_from_disk

        try:
            ds = load_from_disk(str(files[0]))
        except Exception as exc:
            raise DataError(f"{files[0]}: cannot load the saved dataset: {type(exc).__name__}: {exc}") from exc
        yield from _iter_rows(ds, str(files[0]))
        return
    for f in files:
        if f.suffix == ".jsonl":
            yield from iter_jsonl(f)
        elif f.suffix == ".json":
            yield from _iter_json_array(f)
        else:
            yield from _iter_columnar(f, streaming)


def read_source(source: DataSource | str, streaming: bool = True) -> list[PromptRecord]:
    """All records of a source, each tagged with the source's name; one DataError lists the bad rows."""
    source = source if isinstance(source, DataSource) else parse_sources(source)[0]
    records = collect(source.path, iter_records(source.path, streaming))
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
