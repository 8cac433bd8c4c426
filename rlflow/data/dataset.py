"""Reads prompt datasets: XTuner's RL jsonl and TRL-style rows, checked row by row.

XTuner's rows carry ``data_source``, ``prompt`` (chat messages), ``ability``, ``reward_model.ground_truth``
and ``extra_info``; TRL's carry ``prompt`` as a string or messages plus any columns the reward functions
want. Both become :class:`PromptRecord`: the prompt as written and every other column, with
``reward_model.ground_truth`` also lifted to a ``ground_truth`` column as XTuner's judgers expect. Every
problem names the file, the line and the field, and all of them are reported at once, before training.

:class:`PromptFormat` turns a record into the text the model sees: chat messages (one turn or several) through
the tokenizer's chat template, with an optional system-prompt override and extra template kwargs such as
Qwen3's ``enable_thinking``; plain strings as written, or through a ``{prompt}`` template. Reading formats other
than jsonl (parquet, ``datasets`` saves, shard directories) lives in :mod:`rlflow.data.sources`.
"""

from __future__ import annotations

import ast
import json
import math
from collections.abc import Iterable, Iterator
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
    origin: str = ""  # the name of the configured data source it was read from
    images: list[str | bytes] | None = None  # resolved images (rlflow.data.images), set when the prompt is encoded

    @property
    def data_source(self) -> str | None:
        return self.columns.get("data_source")


def _type_name(value: Any) -> str:
    return type(value).__name__


#: The keywords a judger call gets besides the data's columns (:mod:`rlflow.judgers.context`): a column of one of
#: these names would replace the completions (or the run's state) a judger reads.
RESERVED_COLUMNS = frozenset({"prompts", "completions", "completion_ids", "trainer_state", "log_extra",
                              "log_metric", "environments", "env_reward"})


def encoded_messages(text: str) -> list[Any] | None:
    """The chat messages a string prompt holds as text, else None: JSON (``[{"role": "user", ...}]``) or the
    Python form pandas' ``to_csv`` writes (``[{'role': 'user', ...}]``), a CSV cell's only ways to hold them. Only a
    non-empty list of objects that each have ``role`` and ``content`` counts; anything else stays the text it is."""
    stripped = text.strip()
    if not (stripped.startswith("[") and stripped.endswith("]") and "role" in stripped):
        return None
    value: Any = None
    try:
        value = json.loads(stripped)
    except ValueError:
        try:
            value = ast.literal_eval(stripped)  # literals only: nothing in the text runs
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return None
    if isinstance(value, list) and value and all(isinstance(m, dict) and {"role", "content"} <= set(m)
                                                 for m in value):
        return value
    return None


def check_row(row: Any, where: str) -> PromptRecord:
    """Validate one parsed row and turn it into a :class:`PromptRecord`; raise DataError naming the field."""
    if not isinstance(row, dict):
        raise DataError(f"{where}: the row must be a JSON object, got {_type_name(row)}")
    if "prompt" not in row:
        hint = "; raw GSM8K? convert it with tools/convert_gsm8k.py" if {"question", "answer"} <= set(row) else ""
        raise DataError(
            f"{where}: field 'prompt' is missing (columns present: {', '.join(sorted(row)) or 'none'}){hint}"
        )
    prompt = row["prompt"]
    if isinstance(prompt, str):
        prompt = encoded_messages(prompt) or prompt
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(f"{where}: field 'prompt' is an empty string")
    elif isinstance(prompt, list):
        if not prompt:
            raise DataError(f"{where}: field 'prompt' is an empty list of messages")
        for j, message in enumerate(prompt):
            if not isinstance(message, dict):
                raise DataError(
                    f"{where}: field 'prompt[{j}]' must be an object with 'role' and 'content', "
                    f"got {_type_name(message)}"
                )
            role, content = message.get("role"), message.get("content")
            if role not in ROLES:
                raise DataError(f"{where}: field 'prompt[{j}].role' must be one of {', '.join(ROLES)}, got {role!r}")
            if not isinstance(content, str):
                raise DataError(f"{where}: field 'prompt[{j}].content' must be a string, got {_type_name(content)}")
        if prompt[-1].get("role") in ("assistant", "system"):
            last = prompt[-1]["role"]
            raise DataError(
                f"{where}: field 'prompt[{len(prompt) - 1}].role' is {last!r}: "
                "a prompt must end with a user (or tool) message for the policy to answer"
                + ("; drop the trailing assistant turn" if last == "assistant" else "")
            )
        pictured = any(row.get(name) not in (None, [], ()) for name in ("images", "image"))  # an image may ask
        if not pictured and not any(m["role"] in ("user", "tool") and m["content"].strip() for m in prompt):
            raise DataError(f"{where}: field 'prompt' has no user message with text")
    else:
        raise DataError(
            f"{where}: field 'prompt' must be a string or a list of chat messages, got {_type_name(prompt)}"
        )
    for key, kind in (("data_source", str), ("ability", str), ("reward_model", dict), ("extra_info", dict)):
        if key in row and row[key] is not None and not isinstance(row[key], kind):
            raise DataError(
                f"{where}: field '{key}' must be a {'string' if kind is str else 'JSON object'}, "
                f"got {_type_name(row[key])}"
            )
    reserved = sorted(RESERVED_COLUMNS & set(row))
    if reserved:
        raise DataError(f"{where}: column {reserved[0]!r} is a keyword judgers are called with (TRL's reward "
                        f"function contract), not a data column: rename it")
    columns = {key: value for key, value in row.items() if key != "prompt"}
    reward_model = row.get("reward_model") or {}
    if "ground_truth" in reward_model and "ground_truth" not in columns:
        truth = reward_model["ground_truth"]
        items = truth if isinstance(truth, list) else [truth]
        bad = [t for t in items if not isinstance(t, (str, int, float)) or isinstance(t, bool)
               or (isinstance(t, float) and not math.isfinite(t))]
        if not items or bad:
            got = _type_name(truth) if not isinstance(truth, list) else (
                f"a list holding {_type_name(bad[0])}" if bad else "an empty list")
            if bad and isinstance(bad[0], float):
                got = f"{bad[0]} (not a number a completion can state)"
            raise DataError(
                f"{where}: field 'reward_model.ground_truth' must be a string, a number or a list of them "
                f"(acceptable answers), got {got}"
            )
        columns["ground_truth"] = truth
    return PromptRecord(prompt=prompt, columns=columns, source=where)


BOM = "\ufeff"  # a byte-order mark some editors write first


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    repeated = next((key for key in keys if keys.count(key) > 1), None)
    if repeated is not None:  # json keeps the last silently: a row would train on half of what it says
        raise DataError(f"key {repeated!r} appears twice in one object")
    return dict(pairs)


def load_json(text: str) -> Any:
    """``json.loads`` that refuses an object with a key twice (a DataError without the place: the caller adds it)."""
    return json.loads(text, object_pairs_hook=_unique_keys)


def json_error(exc: json.JSONDecodeError) -> str:
    """``invalid JSON at column N: <reason>`` (json's "Invalid control character at" ends where its position goes);
    ``invalid JSON at the end of the line`` (of the file, for a document of several lines) where the text stops
    before the value does (a missing ``}``): json counts the line's own newline as the start of a next line."""
    reason = exc.msg.removesuffix(" at")
    text = exc.doc.rstrip() if isinstance(exc.doc, str) else ""
    if text and exc.pos >= len(text):
        return f"invalid JSON at the end of the {'file' if chr(10) in text else 'line'}: {reason}"
    hint = ""
    if isinstance(exc.doc, str) and "\r" in exc.doc.rstrip("\r\n"):  # rows split by a lone CR: one line here
        hint = " (the line holds a carriage return: rows must end with a newline, \\n or \\r\\n)"
    return f"invalid JSON at column {exc.colno}: {reason}{hint}"


def iter_jsonl(path: str | Path) -> Iterator[tuple[str, PromptRecord | DataError]]:
    """Stream a jsonl file line by line: ``(file:line, record)`` for good rows, ``(file:line, DataError)`` for bad ones.

    Memory stays flat however large the file is; blank lines are skipped. A missing file raises at once.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: data file not found" if not path.exists() else f"{path}: not a file")
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
                text = raw.decode("utf-8")
                row = load_json(text[1:] if lineno == 1 and text.startswith(BOM) else text)
            except json.JSONDecodeError as exc:
                yield where, DataError(f"{where}: {json_error(exc)}")
                continue
            except DataError as exc:
                yield where, DataError(f"{where}: {exc}")
                continue
            except UnicodeDecodeError as exc:
                yield where, DataError(f"{where}: not UTF-8 text: {exc}")
                continue
            try:
                yield where, check_row(row, where)
            except DataError as exc:
                yield where, exc


def collect(path: str | Path, items: Iterable[tuple[str, PromptRecord | DataError]]) -> list[PromptRecord]:
    """Keep the records of ``items``; raise one DataError listing the first problems if any row was bad."""
    records, errors, total_errors = [], [], 0
    for _, item in items:
        if isinstance(item, DataError):
            total_errors += 1
            if len(errors) < MAX_REPORTED_ERRORS:
                errors.append(str(item))
        else:
            records.append(item)
    if errors:
        shown = "\n  ".join(errors)
        more = f"\n  ... and {total_errors - MAX_REPORTED_ERRORS} more" if total_errors > MAX_REPORTED_ERRORS else ""
        raise DataError(f"{total_errors} malformed row(s) in {path}; fix them before training:\n  {shown}{more}")
    if not records:
        raise DataError(f"{path}: the dataset is empty (no rows)")
    return records


def read_jsonl(path: str | Path) -> list[PromptRecord]:
    """Read and check every row of a jsonl file; raise one DataError listing the first problems found."""
    return collect(path, iter_jsonl(path))


class PromptFormat:
    """Renders a record into the prompt text the model sees, the same way for training, evaluation and checks.

    Chat prompts (one turn or several) go through the tokenizer's chat template with ``add_generation_prompt``;
    plain strings are used as written (TRL's standard format) or through ``prompt_template``.

    Args:
        system_prompt: If set, replaces (or adds) the system message of every chat prompt.
        prompt_template: If set, plain-string prompts become ``prompt_template.format(prompt=..., **columns)``,
            e.g. ``"Question: {prompt}\\nAnswer:"``; literal braces are written ``{{`` and ``}}``.
        chat_template_kwargs: Extra keyword arguments for ``apply_chat_template`` (e.g. ``enable_thinking: false``).
    """

    def __init__(
        self,
        system_prompt: str | None = None,
        prompt_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.system_prompt = system_prompt
        self.prompt_template = prompt_template
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        if prompt_template is not None:
            import string

            try:
                names = [name for _, name, _, _ in string.Formatter().parse(prompt_template) if name is not None]
            except ValueError as exc:
                raise ValueError(f"prompt_template {prompt_template!r} is not a valid format string: {exc}") from exc
            if "prompt" not in names:
                raise ValueError(
                    f"prompt_template {prompt_template!r} has no '{{prompt}}' placeholder for the prompt text"
                )
            self._fields = [n for n in names if n]

    def render(self, record: PromptRecord, tokenizer: Any) -> str:
        """The prompt text of ``record``; raise DataError naming the row when it cannot be rendered."""
        if isinstance(record.prompt, str):
            if self.prompt_template is None:
                return record.prompt
            values = {**record.columns, "prompt": record.prompt}
            missing = [name for name in self._fields if name.split(".")[0].split("[")[0] not in values]
            if missing:
                raise DataError(
                    f"{record.source}: prompt_template needs field(s) {', '.join(sorted(set(missing)))}, which the row "
                    f"lacks (columns: {', '.join(sorted(values))})"
                )
            try:
                return self.prompt_template.format(**values)
            except (KeyError, IndexError, AttributeError, TypeError) as exc:  # {extra_info[level]} on a row without it
                raise DataError(
                    f"{record.source}: prompt_template cannot be filled from this row: {type(exc).__name__}: {exc}"
                ) from exc
        messages = list(record.prompt)
        if self.system_prompt is not None:
            messages = [m for m in messages if m["role"] != "system"]
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"{record.source}: field 'prompt' is a list of chat messages but the tokenizer "
                f"{getattr(tokenizer, 'name_or_path', '')!r} has no chat template; use a chat/instruct tokenizer, set "
                "one, or give prompts as plain strings"
            )
        try:
            return tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
            )
        except Exception as exc:  # jinja raises its own errors, e.g. "System message must be at the beginning"
            raise DataError(
                f"{record.source}: the chat template rejected field 'prompt': {type(exc).__name__}: {exc}"
            ) from exc
