"""Writes the guide's generated reference pages from the code, so they say what the code says.

* ``docs/configuration.md``: every ``model.*`` and ``data.*`` key from the typed signatures of
  ``GRPOModule.__init__`` and ``RolloutDataModule.__init__`` (a parameter typed with a dataclass becomes a group of
  keys, one per field, recursively), and the callback sections ``rlflow fit`` adds (``checkpoint.*``,
  ``samples.*``, ...): name, type, default and documentation (the ``Args:`` section of the ``__init__`` docstring,
  the fields' attribute docstrings, parsed with ``docstring_parser`` as jsonargparse parses them).
* ``docs/errors.md``: every message rlflow prints as one ``rlflow: error:`` line, found in the source by ``ast``:
  each ``raise`` of an exception class ``rlflow.cli`` treats as a user error (or a subclass of one), with the
  message's fixed text and ``<placeholders>`` for its variable parts.

    python tools/gen_config_reference.py           # rewrite the pages
    python tools/gen_config_reference.py --check   # exit 1 if a checked-in page differs from what the code gives
"""

from __future__ import annotations

import argparse
import ast
import builtins
import dataclasses
import importlib
import inspect
import json
import re
import sys
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rlflow"
CONFIG_PAGE = ROOT / "docs" / "configuration.md"
ERRORS_PAGE = ROOT / "docs" / "errors.md"

# (config prefix, "module:Class") of the LightningCLI's model and data classes
SECTIONS = [("model", "rlflow.training.module:GRPOModule"), ("data", "rlflow.data.datamodule:RolloutDataModule")]

# troubleshooting.md's section for the errors raised under each path (the longest matching prefix wins)
ERROR_FAMILIES = {
    "rlflow/": "other-errors",
    "rlflow/cli.py": "a-setting-or-a-plugin-option",
    "rlflow/config_moves.py": "a-key-that-moved",
    "rlflow/training/export.py": "rlflow-export",
    "rlflow/config_checks.py": "a-setting-or-a-plugin-option",
    "rlflow/data/settings.py": "a-setting-or-a-plugin-option",
    "rlflow/training/": "a-setting-or-a-plugin-option",
    "rlflow/losses/": "a-setting-or-a-plugin-option",
    "rlflow/rollout/": "a-setting-or-a-plugin-option",
    "rlflow/rollout/pipeline.py": "pipelined-generation",
    "rlflow/rollout/staleness.py": "pipelined-generation",
    "rlflow/rollout/process.py": "pipelined-generation",
    "rlflow/rollout/split.py": "pipelined-generation",
    "rlflow/registry.py": "plugins",
    "rlflow/judgers/": "plugins",
    "rlflow/tools/": "plugins",
    "rlflow/environments/": "plugins",
    "rlflow/data/": "data",
    "rlflow/judgers/panel.py": "data",
    "rlflow/models/": "the-model",
    "rlflow/models/lora.py": "lora",
    "rlflow/models/vision.py": "vision-language-models",
    "rlflow/data/images.py": "vision-language-models",
    "rlflow/rollout/base.py": "the-model",
    "rlflow/training/module.py": "a-setting-or-a-plugin-option",
    "rlflow/training/checkpointing.py": "during-a-run",
}


# --------------------------------------------------------------------------------------------- text helpers
def markdown(text: str | None) -> str:
    """A docstring's text as one line of Markdown: Sphinx roles and double backticks become code spans."""
    if not text:
        return ""
    text = " ".join(text.split())
    text = re.sub(r":(?:py:)?(?:mod|class|func|meth|attr|data|obj|exc):`~?([^`]+)`", r"`\1`", text)
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    return escape_cell(text)


def escape_cell(text: str) -> str:
    """``|`` outside code spans escaped, so that a table cell stays one cell (a table keeps a code span's pipes)."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(part if i % 2 else part.replace("|", "\\|") for i, part in enumerate(parts))


def code(text: str) -> str:
    """``text`` as a Markdown code span (longer backtick fences where it holds backticks)."""
    fence = "``" if "`" in text else "`"
    pad = " " if "`" in text else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def show_value(value: Any) -> str:
    """A default as it would be written in the YAML config."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value) if value == "" or value.strip() != value else value
    if isinstance(value, (list, tuple, dict)):
        try:
            return json.dumps(value)
        except TypeError:
            return repr(value)
    return repr(value)


def show_type(annotation: Any) -> str:
    """The annotation as written in the source (a string under ``from __future__ import annotations``)."""
    if annotation is inspect.Parameter.empty:
        return ""
    if isinstance(annotation, str):
        return annotation
    return inspect.formatannotation(annotation)


# --------------------------------------------------------------------------------------------- the config reference
@dataclasses.dataclass
class Key:
    name: str
    type: str
    default: str | None  # None: required
    doc: str


@dataclasses.dataclass
class Group:
    prefix: str
    title: str
    doc: str
    keys: list[Key]
    groups: list[Group]


def load(spec: str) -> Any:
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def resolved_hints(obj: Any) -> dict[str, Any]:
    """``obj``'s annotations evaluated, each on its own (one that cannot be resolved is left out)."""
    raw = getattr(obj, "__annotations__", {})
    module = sys.modules.get(getattr(obj, "__module__", ""), None)
    namespace = dict(vars(module)) if module else {}
    hints: dict[str, Any] = {}
    for name, annotation in raw.items():
        if not isinstance(annotation, str):
            hints[name] = annotation
            continue
        try:
            hints[name] = eval(annotation, namespace)  # noqa: S307 - annotations of our own source
        except Exception:  # a name imported only for type checking: no dataclass to expand there
            continue
    return hints


def settings_class(annotation: Any) -> type | None:
    """The dataclass a parameter is typed with (``X`` or ``X | None``), else None."""
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        return annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(args) == 1 and dataclasses.is_dataclass(args[0]) and isinstance(args[0], type):
        return args[0]
    return None


def docstring_params(obj: Any) -> dict[str, str]:
    """Parameter (or attribute) descriptions of ``obj``'s docstring(s), as jsonargparse reads them."""
    import docstring_parser

    try:
        parsed = docstring_parser.parse_from_object(obj)
    except Exception:
        parsed = docstring_parser.parse(inspect.getdoc(obj) or "")
    return {p.arg_name: p.description or "" for p in parsed.params}


def summary(obj: Any) -> str:
    """The first paragraph of ``obj``'s own docstring (not an inherited one)."""
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else obj.__doc__
    if not doc:
        return ""
    return markdown(inspect.cleandoc(doc).split("\n\n", 1)[0])


def group_of(prefix: str, cls: type, documented: Any, members: list[tuple[str, str, str | None]]) -> Group:
    """``cls``'s keys under ``prefix``: ``members`` are ``(name, type, default)``, ``documented`` the object whose
    docstring and annotations describe them; a member typed with a dataclass becomes a group of its own."""
    docs, hints = docstring_params(documented), resolved_hints(documented)
    keys, groups = [], []
    for name, type_text, default in members:
        nested = settings_class(hints.get(name))
        if nested is None:
            keys.append(Key(f"{prefix}.{name}", type_text, default, markdown(docs.get(name))))
            continue
        group = dataclass_group(f"{prefix}.{name}", nested)
        group.doc = markdown(docs.get(name)) or group.doc  # the parameter's own words where it has them
        groups.append(group)
    doc = re.sub(rf"^`{re.escape(prefix)}`: ", "", summary(cls))  # the heading names the key already
    return Group(prefix, cls.__name__, doc[:1].upper() + doc[1:], keys, groups)


def dataclass_group(prefix: str, cls: type) -> Group:
    def default(field: dataclasses.Field) -> str | None:
        if field.default is not dataclasses.MISSING:
            return show_value(field.default)
        if field.default_factory is not dataclasses.MISSING:
            return show_value(field.default_factory())
        return None

    fields = [f for f in dataclasses.fields(cls) if f.init]
    return group_of(prefix, cls, cls, [(f.name, show_type(f.type), default(f)) for f in fields])


def signature_group(prefix: str, cls: type) -> Group:
    params = [p for name, p in inspect.signature(cls.__init__).parameters.items()
              if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    members = [(p.name, show_type(p.annotation), None if p.default is p.empty else show_value(p.default))
               for p in params]
    return group_of(prefix, cls, cls.__init__, members)


def callback_sections() -> list[tuple[str, str]]:
    """``(prefix, "module:Class")`` of every ``parser.add_lightning_class_args(Class, "prefix")`` in rlflow.cli."""
    source = PACKAGE / "cli.py"
    tree = ast.parse(source.read_text())
    imported = {alias.asname or alias.name: f"{node.module}:{alias.name}"
                for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
                for alias in node.names}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_lightning_class_args" and len(node.args) >= 2
                and isinstance(node.args[0], ast.Name) and isinstance(node.args[1], ast.Constant)):
            cls = node.args[0].id
            found.append((node.args[1].value, imported.get(cls, f"rlflow.cli:{cls}")))
    return found


def render_group(group: Group, depth: int) -> Iterator[str]:
    yield f"{'#' * depth} `{group.prefix}`"
    yield ""
    intro = f"`{group.title}`" + (f": {group.doc}" if group.doc else "")
    yield intro
    yield ""
    if group.keys:
        yield "| key | type | default | description |"
        yield "| --- | --- | --- | --- |"
        for key in group.keys:
            default = "required" if key.default is None else code(key.default)
            yield f"| `{key.name}` | {code(key.type) if key.type else ''} | {default} | {key.doc} |"
        yield ""
    for sub in group.groups:
        yield from render_group(sub, min(depth + 1, 4))


CONFIG_INTRO = """\
# Configuration reference

<!-- Generated by `python tools/gen_config_reference.py` from the code's signatures and docstrings: do not edit. -->

A run's configuration has three main sections: `trainer` (Lightning's `Trainer`), `model` (the arguments of
`GRPOModule`) and `data` (the arguments of `RolloutDataModule`), plus the callback sections below. Every key is
the same in YAML, on the command line and in Python:

=== "YAML"

    ```yaml
    model:
      optim: {lr: 1.0e-4}
    data:
      sampling: {max_tokens: 32}
    ```

=== "command line"

    ```bash
    rlflow fit --config my.yaml --model.optim.lr 1e-4 --data.sampling.max_tokens 32
    ```

=== "Python"

    ```python
    GRPOModule(model_path=..., optim=OptimSettings(lr=1e-4))   # or optim={"lr": 1e-4}
    RolloutDataModule(train_data_path=..., sampling=SamplingSettings(max_tokens=32))
    ```

A key typed as a settings class is a group of keys (`model.optim.lr`); a group can be given whole as a mapping
(`--model.optim '{lr: 1e-4, warmup_steps: 2}'`). Plugins (`model.loss`, `data.rollout`, `data.advantage`, the
judgers) take a short name or `class_path`/`init_args`; `rlflow fit --model.loss.help bnpo` lists one plugin's
options. A wrong value stops the command before anything slow with one `rlflow: error:` line naming the key
([error messages](errors.md)). `rlflow fit --help` prints the same documentation, and
`rlflow fit --config my.yaml --print_config` the resolved configuration.
"""


def config_page() -> str:
    lines = [CONFIG_INTRO]
    for prefix, spec in SECTIONS:
        lines.extend(render_group(signature_group(prefix, load(spec)), 2))
    lines.append("## Callback sections")
    lines.append("")
    lines.append("Callbacks `rlflow fit` adds, each configured under its own key. All step counts are rollout steps.")
    lines.append("")
    for prefix, spec in callback_sections():
        lines.extend(render_group(signature_group(prefix, load(spec)), 3))
    lines.extend(moved_keys())
    return "\n".join(lines).rstrip() + "\n"


def moved_keys() -> list[str]:
    """The table of keys that moved into groups (``rlflow.config_moves``), where the code has one."""
    try:
        moves = importlib.import_module("rlflow.config_moves")
    except ImportError:
        return []
    lines = ["## Keys that moved", "",
             "A key of the flat layout of rlflow 0.1 is an error naming its new place; the whole table:", "",
             "| old key | new key |", "| --- | --- |"]
    for section, keys in moves.MOVED.items():
        for key in keys:
            lines.append(f"| `{section}.{key}` | `{moves.new_place(section, key)}` |")
    return lines


# --------------------------------------------------------------------------------------------- the error index
def user_error_names() -> set[str]:
    """Names of the exception classes ``rlflow.cli`` prints as one line, and of their subclasses in rlflow."""
    tree = ast.parse((PACKAGE / "cli.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "_user_errors":
            for ret in ast.walk(node):
                if isinstance(ret, ast.Return) and isinstance(ret.value, ast.Tuple):
                    names |= {e.id for e in ret.value.elts if isinstance(e, ast.Name)}
    names -= set(dir(builtins))  # FileNotFoundError & co.: the operating system's messages
    bases: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases.setdefault(node.name, set()).update(
                    b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                    if isinstance(b, (ast.Name, ast.Attribute)))
    grown = True
    while grown:
        new = {name for name, of in bases.items() if of & names} - names
        names |= new
        grown = bool(new)
    return names


def template(node: ast.expr) -> str:
    """The message an expression builds: fixed text as is, the variable parts as ``<expression>``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue):
                parts.append(placeholder(value.value))
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return template(node.left) + template(node.right)
    return placeholder(node)


def placeholder(node: ast.expr) -> str:
    """``<name>`` for a variable part that is a name or an attribute (``<self.max_tokens>``), else ``<...>``."""
    simple = isinstance(node, (ast.Name, ast.Attribute)) or (
        isinstance(node, ast.Subscript) and isinstance(node.value, (ast.Name, ast.Attribute)))
    return f"<{ast.unparse(node)}>" if simple else "<...>"


def is_text(node: ast.expr) -> bool:
    """Whether ``node`` builds a string (a literal, an f-string or a sum of them)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return is_text(node.left) or is_text(node.right)
    return isinstance(node, ast.JoinedStr)


Template = tuple[list[str], ast.expr]  # a callable's parameter names and the text expression it builds


def called(node: ast.expr) -> str:
    """The name a call calls (``f`` of ``f(...)`` and of ``mod.f(...)``), else ""."""
    if not isinstance(node, ast.Call):
        return ""
    return node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")


def fill(spec: Template, call: ast.Call) -> str:
    """A callable's text template with its parameters replaced by what ``call`` passes."""
    params, body = spec
    given = {name: template(arg) if is_text(arg) else placeholder(arg) for name, arg in zip(params, call.args)}
    return re.sub(r"<(\w+)>", lambda m: given.get(m.group(1), m.group(0)), template(body))


def message_of(call: ast.Call, inits: dict[str, Template], helpers: dict[str, Template]) -> str:
    """The message a raise's exception carries: the class's own template filled with the call's arguments where
    its ``__init__`` builds the message, else the first text argument (``OSError(errno, text)``), a call of a
    helper that returns the text counting as text."""
    if called(call) in inits:
        return fill(inits[called(call)], call)
    texts = [arg for arg in call.args if is_text(arg) or called(arg) in helpers]
    if not texts:
        return template(call.args[0]) if call.args else "<message>"
    first = texts[0]
    return fill(helpers[called(first)], first) if called(first) in helpers else template(first)


def returns(tree: ast.AST) -> dict[str, Template]:
    """``{function: (parameters, what it returns)}`` of a module's functions (the last ``return`` with a value)."""
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            for ret in ast.walk(node):
                if isinstance(ret, ast.Return) and ret.value is not None:
                    found[node.name] = ([a.arg for a in node.args.args], ret.value)
    return found


def message_templates(errors: set[str]) -> dict[str, Template]:
    """``{class: (parameters, message)}`` of the error classes whose ``__init__`` passes a built message up."""
    inits = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ClassDef) and node.name in errors):
                continue
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    for call in ast.walk(item):
                        if (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                                and call.func.attr == "__init__" and call.args and is_text(call.args[0])):
                            inits[node.name] = ([a.arg for a in item.args.args[1:]], call.args[0])
    return inits


@dataclasses.dataclass
class Message:
    path: str
    where: str
    text: str


def error_messages() -> list[Message]:
    errors = user_error_names()
    inits = message_templates(errors)
    found: list[Message] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text())
        functions = returns(tree)
        helpers = {name: spec for name, spec in functions.items() if is_text(spec[1])}  # functions building text
        # functions building an error for their caller to raise (``raise _unknown(group, name)``)
        builders = {name: spec[1] for name, spec in functions.items() if called(spec[1]) in errors}
        for scope, node in walk_scoped(tree):
            if not isinstance(node, ast.Raise) or not isinstance(node.exc, ast.Call):
                continue
            call = node.exc
            name = called(call)
            if name in builders:
                call = builders[name]
            elif name not in errors:
                continue
            text = message_of(call, inits, helpers).strip()
            text = text.split("\n")[0] + (" ..." if "\n" in text else "")
            found.append(Message(rel, scope, text))
    return found


def walk_scoped(node: ast.AST, scope: str = "") -> Iterator[tuple[str, ast.AST]]:
    """Every node under ``node`` with the qualified name of the function or class it is in."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield from walk_scoped(child, f"{scope}.{child.name}" if scope else child.name)
        else:
            yield scope, child
            yield from walk_scoped(child, scope)


def family(path: str) -> str:
    best = max((prefix for prefix in ERROR_FAMILIES if path.startswith(prefix)), key=len)
    return ERROR_FAMILIES[best]


ERRORS_INTRO = """\
# Error messages

<!-- Generated by `python tools/gen_config_reference.py` from the raise statements in rlflow/: do not edit. -->

Every message rlflow ends a command with as one line, `rlflow: error: <message>` (set `RLFLOW_TRACEBACK=1` for
the traceback), in the order of the source. `<...>` stands for a part the message fills in: the key, the value
given, the file and line. The last column links to the troubleshooting section with the cause and the fix.
"""


def errors_page() -> str:
    lines = [ERRORS_INTRO]
    current = None
    for message in error_messages():
        if message.path != current:
            current = message.path
            lines += ["", f"## `{current}`", "", "| message | raised in | cause and fix |", "| --- | --- | --- |"]
        lines.append(f"| {code(message.text)} | `{message.where or '(module)'}` | "
                     f"[troubleshooting](troubleshooting.md#{family(message.path)}) |")
    return "\n".join(lines).rstrip() + "\n"


# --------------------------------------------------------------------------------------------- main
def pages() -> dict[Path, str]:
    return {CONFIG_PAGE: config_page(), ERRORS_PAGE: errors_page()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a checked-in page is not what the code gives")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    stale = []
    for path, text in pages().items():
        shown = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(shown)
        else:
            path.write_text(text)
            print(f"wrote {shown}")
    if stale:
        print(f"stale: {', '.join(stale)}; regenerate with python tools/gen_config_reference.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
