"""jsonargparse's parse errors (an unknown key, a value of the wrong type) as one line naming the file, line and key.

jsonargparse answers a bad setting with the whole usage text (every option of ``rlflow fit``) and an error at its
end. :func:`parse_error_line` keeps what the user needs: where the setting is (``x.yaml, line 3:`` or ``command
line:``), its full key, what was expected and what was given, and for an unknown key the closest known one.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from typing import Any

UNKNOWN_PATTERNS = (
    re.compile(r"does not accept option '([\w.]+)'"),
    re.compile(r"unrecognized arguments: --([\w.]+)"),
    re.compile(r"Key '([\w.]+)' is not expected"),
)
PARSER_KEY = re.compile(r'Parser key "([\w.]+)":')
EXPECTED = re.compile(r"Expected a <class '([\w.]+)'>\. Got value: (.*)")
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


def key_line(path: str, key: str) -> int | None:
    """The 1-based line of the dotted ``key`` in the YAML file at ``path`` (also under a ``fit:`` level), or None."""
    import yaml

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
            return line
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


def nested_key(message: str) -> tuple[str, str | None, str | None]:
    """The full key a type error is about (a plugin's ``init_args`` key included), the expected type and the value."""
    keys = PARSER_KEY.findall(message)
    key = keys[0] if keys else ""
    if len(keys) > 1 and "class_path" in message:
        key = f"{keys[0]}.init_args.{keys[-1]}"
    expected = EXPECTED.findall(message)
    typ, value = expected[-1] if expected else (None, None)
    return key, typ, value


def parse_error_line(message: str, argv: Sequence[str], known_keys: Iterable[str]) -> str:
    """One line for jsonargparse's error ``message`` about ``argv``; ``known_keys`` feed the did-you-mean."""
    for pattern in UNKNOWN_PATTERNS:
        match = pattern.search(message)
        if match:
            key = match.group(1)
            close = difflib.get_close_matches(key, list(known_keys), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else " (`rlflow fit --help` lists the settings)"
            return f"{where(key, argv)}{key} is not a setting{hint}"
    key, typ, value = nested_key(message)
    if key and typ is not None:
        return f"{where(key, argv)}{key}: expected {typ.rsplit('.', 1)[-1]}, got {value}"
    union, given = SUBTYPES.search(message), GIVEN.search(message)
    if key and union and given:  # an Optional/Union setting: every subtype refused the value
        names = re.findall(r"<class '([\w.]+)'>", union.group(1))
        expected = " or ".join("null" if n == "NoneType" else n.rsplit(".", 1)[-1] for n in names) or union.group(1)
        return f"{where(key, argv)}{key}: expected {expected}, got {given.group(1).strip()}"
    first = message.strip().splitlines()[0] if message.strip() else "invalid arguments"
    return f"{where(key, argv) if key else ''}{first}"


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
