"""jsonargparse's parse errors (an unknown key, a value of the wrong type) as one line naming the file, line and key.

jsonargparse answers a bad setting with the whole usage text (every option of ``rlflow fit``) and an error at its
end. :func:`parse_error_line` keeps what the user needs: where the setting is (``x.yaml, line 3:`` or ``command
line:``), its full key, what was expected and what was given, and for an unknown key the closest known one.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import yaml

UNKNOWN_PATTERNS = (
    re.compile(r"does not accept option '([\w.]+)'"),
    re.compile(r"unrecognized arguments: --([\w.]+)"),
    re.compile(r"Key '([\w.]+)' is not expected"),
)
GROUP_OPTION = re.compile(r"Group '([\w.]+)' does not accept option '([\w.]+)'")
NESTED_UNKNOWN = (re.compile(r"Option '([\w.]+)' is not accepted"), re.compile(r"Key '([\w.]+)' is not expected"))
CLASS_PATH = re.compile(r"Problem with given class_path '([\w.]+)'")
PARSER_KEY = re.compile(r'Parser key "([\w.]+)":')
EXPECTED = re.compile(r"Expected a <class '([\w.]+)'>\. Got value: (.*)")
LITERAL = re.compile(r"Expected a typing\.Literal\[(.*)\]\. Got value: (.*)")
REQUIRED = re.compile(r"the following arguments are required: ([\w., ]+)")
IMPORT_PROBLEM = re.compile(r"Problem with given class_path '([\w.:]+)':\s*\n?\s*((?!Parser key)[^\n]+)")
SUBTYPES = re.compile(r"Subtypes: \[(.*)\]")
GIVEN = re.compile(r"Given value: (.*)")


def config_files(argv: Sequence[str]) -> list[str]:
    """The ``--config`` files of ``argv``, in order."""
    files = []
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            files.append(argv[i + 1])
        elif arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
    return files


def _find(path: str, key: str) -> tuple[Any, int] | None:
    """The YAML node of the dotted ``key`` in the file at ``path`` (also under a ``fit:`` level) and its 1-based
    line; None where the file does not set it or cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            node = yaml.compose(f)
    except (OSError, yaml.YAMLError):
        return None
    for parts in (key.split("."), ["fit", *key.split(".")]):
        current, line = node, None
        for part in parts:
            if not isinstance(current, yaml.MappingNode):
                break
            found = next(((k, v) for k, v in current.value if k.value == part), None)
            if found is None:
                break
            line, current = found[0].start_mark.line + 1, found[1]
        else:
            return current, line
    return None


def key_line(path: str, key: str) -> int | None:
    """The 1-based line of the dotted ``key`` in the YAML file at ``path`` (also under a ``fit:`` level), or None."""
    found = _find(path, key)
    return found[1] if found is not None else None


def nested_line(path: str, parent: str, field: str) -> int | None:
    """The 1-based line of ``field`` under an ``init_args`` anywhere inside the setting ``parent`` of the YAML file
    at ``path`` (a judger in ``data.judging.judgers``' routes and lists), or None."""
    found = _find(path, parent)
    stack = [found[0]] if found is not None else []
    while stack:
        item = stack.pop()
        if isinstance(item, yaml.MappingNode):
            for k, v in item.value:
                if k.value == "init_args" and isinstance(v, yaml.MappingNode):
                    hit = next((fk for fk, _ in v.value if fk.value == field), None)
                    if hit is not None:
                        return hit.start_mark.line + 1
                stack.append(v)
        elif isinstance(item, yaml.SequenceNode):
            stack.extend(item.value)
    return None


def where(key: str, argv: Sequence[str]) -> str:
    """``"command line: "`` or ``"x.yaml, line 3: "`` for the last place that sets ``key``; ``""`` if not found."""
    if any(a == f"--{key}" or a.startswith(f"--{key}=") for a in argv):
        return "command line: "
    for path in reversed(config_files(argv)):
        line = key_line(path, key)
        if line is not None:
            return f"{path}, line {line}: "
    return ""


def nested_class(message: str) -> Any:
    """The class of a setting whose value jsonargparse built from a class (``Problem with given class_path``): a
    plugin (``model.loss``) or a settings dataclass (``model.lora``); None if not named or not importable."""
    import importlib

    match = CLASS_PATH.search(message)
    if match is None:
        return None
    module, _, name = match.group(1).rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def class_fields(cls: Any) -> list[str]:
    """The settings ``cls`` takes, as jsonargparse reads them (a plugin's ``**kwargs`` followed to its bases)."""
    import dataclasses
    import inspect

    try:
        from jsonargparse import ArgumentParser

        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(cls, fail_untyped=False)
        return [a.dest for a in parser._actions if isinstance(a.dest, str) and a.dest not in ("help", "config")]
    except Exception:  # noqa: BLE001 - only the did-you-mean depends on it
        if dataclasses.is_dataclass(cls):
            return [f.name for f in dataclasses.fields(cls) if f.init]
        try:
            return [n for n, p in inspect.signature(cls).parameters.items() if p.kind not in (p.VAR_KEYWORD,
                                                                                                p.VAR_POSITIONAL)]
        except (TypeError, ValueError):
            return []


def locate(keys: Sequence[str], argv: Sequence[str]) -> tuple[str, str]:
    """The first of ``keys`` set on the command line, else in the last config file that sets one, with
    :func:`where`'s place; ``(keys[0], "")`` if none is found."""
    for key in keys:
        if any(a == f"--{key}" or a.startswith(f"--{key}=") for a in argv):
            return key, "command line: "
    for path in reversed(config_files(argv)):
        for key in keys:
            line = key_line(path, key)
            if line is not None:
                return key, f"{path}, line {line}: "
    return keys[0], ""


def nested_place(parent: str, field: str, cls: Any, argv: Sequence[str]) -> tuple[str, str]:
    """The full key of ``field`` inside the setting ``parent`` (a plugin's as ``parent.init_args.field``, a settings
    dataclass's as ``parent.field``, or as the user wrote it) and where it is set: the key itself, else ``parent``
    (a whole value on the command line: ``--model.lora '{rr: 8}'``)."""
    import dataclasses

    forms = [f"{parent}.{field}", f"{parent}.init_args.{field}"]
    if cls is not None and not dataclasses.is_dataclass(cls):
        forms.reverse()
    key, place = locate(forms, argv)
    if not place and not any(a == f"--{parent}" or a.startswith(f"--{parent}=") for a in argv):
        for path in reversed(config_files(argv)):  # deeper: a plugin inside a mapping or list of plugins
            line = nested_line(path, parent, field)
            if line is not None:
                return f"{parent}.init_args.{field}", f"{path}, line {line}: "
    return key, place or where(parent, argv)


def nested_key(message: str, argv: Sequence[str] = ()) -> tuple[str, str, str | None, str | None]:
    """The full key a type error is about (a plugin's ``init_args`` key included), where it is set, the expected
    type and the value."""
    keys = PARSER_KEY.findall(message)
    key = keys[0] if keys else ""
    place = where(key, argv) if key else ""
    if len(keys) > 1 and "class_path" in message:
        key, place = nested_place(keys[0], keys[-1], nested_class(message), argv)
    expected = EXPECTED.findall(message)
    typ, value = expected[-1] if expected else (None, None)
    if typ is not None:
        typ = typ.rsplit(".", 1)[-1]
    elif literal := LITERAL.findall(message):  # a plugin's Literal option: its choices
        choices, value = literal[-1]
        typ = "one of " + ", ".join(c.strip().strip("'\"") for c in choices.split(","))
    return key, place, typ, value


def unknown_line(key: str, place: str, known_keys: Iterable[str], prefix: str = "") -> str:
    """``<place><key> is not a setting; did you mean <the closest of known_keys>?`` (``prefix`` + each known key:
    the fields of a nested setting)."""
    known = [prefix + k for k in known_keys]
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else " (`rlflow fit --help` lists the settings)"
    return f"{place}{key} is not a setting{hint}"


MISSING_FILE = re.compile(r"File does not exist: '([^']*)'")


def config_file_problem(message: str, argv: Sequence[str]) -> str | None:
    """What is wrong with a ``--config`` file as a whole (missing, not YAML, not a mapping of settings), naming it;
    None where every file reads as a mapping."""
    missing = MISSING_FILE.search(message)
    if missing and 'key "config"' in message:
        return f"--config {missing.group(1)}: no such file"
    if not message.startswith(("Unexpected config", "Problems parsing config")):
        return None
    for path in config_files(argv):
        try:
            value = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = f", line {mark.line + 1}" if mark is not None else ""
            problem = getattr(exc, "problem", None) or exc
            return f"{path}{line}: not YAML ({problem}); a config is a YAML mapping of settings"
        except (OSError, UnicodeDecodeError) as exc:
            return f"{path}: cannot be read ({exc})"
        if value is not None and not isinstance(value, dict):
            return f"{path}: not a mapping of settings (the file holds a YAML {type(value).__name__})"
    return None


def parse_error_line(message: str, argv: Sequence[str], known_keys: Iterable[str]) -> str:
    """One line for jsonargparse's error ``message`` about ``argv``; ``known_keys`` feed the did-you-mean."""
    whole_file = config_file_problem(message, argv)
    if whole_file is not None:
        return whole_file
    group = GROUP_OPTION.search(message)
    if group:  # "Group 'data' does not accept option 'sampling.max_tokenz'": a key of a config file
        key = f"{group.group(1)}.{group.group(2)}"
        return unknown_line(key, where(key, argv), known_keys)
    parents = PARSER_KEY.findall(message)
    nested = next((m for m in (p.search(message) for p in NESTED_UNKNOWN) if m), None)
    if parents and nested:  # an unknown field of a plugin's init_args or of a settings dataclass (model.lora)
        cls = nested_class(message)
        key, place = nested_place(parents[0], nested.group(1), cls, argv)
        fields = class_fields(cls) if cls is not None else []
        return unknown_line(key, place, fields, key[: len(key) - len(nested.group(1))])
    for pattern in UNKNOWN_PATTERNS:
        match = pattern.search(message)
        if match:
            key = match.group(1)
            return unknown_line(key, where(key, argv), known_keys)
    key, place, typ, value = nested_key(message, argv)
    if key and typ is not None:
        return f"{place}{key}: expected {typ}, got {value}"
    required, problem = REQUIRED.search(message), IMPORT_PROBLEM.search(message)
    if key and required and "class_path" in message:  # a plugin's argument without a default, not given
        plugin = CLASS_PATH.search(message)
        names = ", ".join(f"init_args.{n.strip()}" for n in required.group(1).split(","))
        return f"{place}{key}: {plugin.group(1) if plugin else 'the plugin'} needs {names}"
    if key and problem:  # a class_path that does not import, or that is not a plugin of this option
        return f"{place}{key}: class_path {problem.group(1)!r}: {problem.group(2).strip()}"
    union, given = SUBTYPES.search(message), GIVEN.search(message)
    if key and union and given:  # an Optional/Union setting: every subtype refused the value
        names = re.findall(r"<class '([\w.]+)'>", union.group(1))
        expected = " or ".join("null" if n == "NoneType" else n.rsplit(".", 1)[-1] for n in names) or union.group(1)
        return f"{place}{key}: expected {expected}, got {given.group(1).strip()}"
    first = message.strip().splitlines()[0] if message.strip() else "invalid arguments"
    return f"{place}{first}"


def parser_keys(parser: Any) -> list[str]:
    """Every option key of ``parser`` and of its subcommands' parsers (``data.sampling.max_tokens`` ...)."""
    keys: list[str] = []
    parsers = [parser]
    subcommands = getattr(parser, "_subcommands_action", None)
    if subcommands is not None:
        parsers += list(subcommands._name_parser_map.values())
    for p in parsers:
        keys += [a.dest for a in p._actions if isinstance(getattr(a, "dest", None), str)]
    return keys


def raise_errors(parser: Any) -> None:
    """Make ``parser`` and its subcommands' parsers raise their errors instead of printing usage and exiting."""
    parser.exit_on_error = False
    subcommands = getattr(parser, "_subcommands_action", None)
    for p in subcommands._name_parser_map.values() if subcommands is not None else ():
        p.exit_on_error = False
