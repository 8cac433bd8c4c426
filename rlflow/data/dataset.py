"""Reads prompt datasets: XTuner's RL jsonl and TRL-style rows, checked row by row.

XTuner's rows carry ``data_source``, ``prompt`` (chat messages), ``ability``, ``reward_model.ground_truth``
and ``extra_info``; TRL's carry ``prompt`` as a string or messages plus any columns the reward functions
want. Both become :class:`PromptRecord`: the prompt as written and every other column, with
``reward_model.ground_truth`` also lifted to a ``ground_truth`` column as XTuner's judgers expect. Every
problem names the file, the line and the field, and all of them are reported at once, before training.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
MAX_REPORTED_ERRORS = 10


class DataError(ValueError):
    """A dataset cannot be used; the message names the file, line and field of each problem."""


@dataclass
class PromptRecord:
    """One prompt of a dataset: the prompt as written, its other columns, and where it came from."""

    prompt: str | list[dict[str, Any]]
    columns: dict[str, Any]
    source: str
    prompt_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""

    @property
    def data_source(self) -> str | None:
        return self.columns.get("data_source")


def _type_name(value: Any) -> str:
    return type(value).__name__


def check_row(row: Any, where: str) -> PromptRecord:
    """Validate one parsed row and turn it into a :class:`PromptRecord`; raise DataError naming the field."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: the row must be a JSON object, got {_type_name(row)}")
    if "prompt" not in row:
        raise DataError(f"{where}: field 'prompt' is missing (columns present: {', '.join(sorted(row)) or 'none'})")
    prompt = row["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: field 'prompt' is an empty string")
    elif isinstance(prompt, list):
        if not prompt:
            raise DataError(f"{where}: field 'prompt' is an empty list of messages")
        for j, message in enumerate(prompt):
            if not isinstance(message, dict):
                raise DataError(f"{where}: field 'prompt[{j}]' must be an object with 'role' and 'content', got {_type_name(message)}")
            role, content = message.get("role"), message.get("content")
            if role not in ROLES:
                raise DataError(f"{where}: field 'prompt[{j}].role' must be one of {', '.join(ROLES)}, got {role!r}")
            if not isinstance(content, str):
                raise DataError(f"{where}: field 'prompt[{j}].content' must be a string, got {_type_name(content)}")
    else:
        raise DataError(f"{where}: field 'prompt' must be a string or a list of chat messages, got {_type_name(prompt)}")
    for key, kind in (("data_source", str), ("ability", str), ("reward_model", dict), ("extra_info", dict)):
        if key in row and row[key] is not None and not isinstance(row[key], kind):
            raise DataError(f"{where}: field '{key}' must be a {'string' if kind is str else 'JSON object'}, got {_type_name(row[key])}")
    columns = {key: value for key, value in row.items() if key != "prompt"}
    reward_model = row.get("reward_model") or {}
    if "ground_truth" in reward_model and "ground_truth" not in columns:
        truth = reward_model["ground_truth"]
        if not isinstance(truth, (str, int, float, list)) or isinstance(truth, bool):
            raise DataError(f"{where}: field 'reward_model.ground_truth' must be a string or number, got {_type_name(truth)}")
        columns["ground_truth"] = truth
    return PromptRecord(prompt=prompt, columns=columns, source=where)


def read_jsonl(path: str | Path) -> list[PromptRecord]:
    """Read and check every row of a jsonl file; raise one DataError listing the first problems found."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: data file not found" if not path.exists() else f"{path}: not a file")
    records, errors, total_errors = [], [], 0
    try:
        handle = path.open("rb")
    except OSError as exc:
        raise DataError(f"{path}: cannot read the data file: {exc}") from exc
    with handle:
        for lineno, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(raw.decode("utf-8"))
                records.append(check_row(row, where))
            except json.JSONDecodeError as exc:
                total_errors += 1
                errors.append(f"{where}: invalid JSON at column {exc.colno}: {exc.msg}")
            except DataError as exc:
                total_errors += 1
                errors.append(str(exc))
            except UnicodeDecodeError as exc:
                total_errors += 1
                errors.append(f"{where}: not UTF-8 text: {exc}")
    if errors:
        shown = "\n  ".join(errors[:MAX_REPORTED_ERRORS])
        more = f"\n  ... and {total_errors - MAX_REPORTED_ERRORS} more" if total_errors > MAX_REPORTED_ERRORS else ""
        raise DataError(f"{total_errors} malformed row(s) in {path}; fix them before training:\n  {shown}{more}")
    if not records:
        raise DataError(f"{path}: the dataset is empty (no rows)")
    return records
