"""``rlflow config from-trl FILE``: an rlflow config (YAML, on stdout) from a TRL GRPO config.

The file is what ``trl grpo --config FILE`` reads (YAML, or JSON): ``GRPOConfig``'s fields, the script's
(``dataset_name``, ``dataset_config``, ``dataset_train_split``, ``reward_funcs``...) and ``ModelConfig``'s
(``model_name_or_path``, LoRA). Fields it leaves out take TRL's defaults, so the rlflow config means what the TRL
run did; each field goes through its conversion (:mod:`rlflow.trl_config.fields`). A value with no mechanical
counterpart is listed in a comment at the top (``# not converted: field: reason``); a field TRL does not have
is one ``rlflow: error:`` line naming the file, line and field.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from dataclasses import dataclass, field
from typing import Any

import yaml

from rlflow.config_error import ConfigError
from rlflow.trl_config.fields import FIELDS
from rlflow.trl_config.run import NotConverted, RefusedByTRL, TrlRun, coerce

#: The output's top-level keys, in this order (others after them).
SECTIONS = ("seed_everything", "trainer", "checkpoint", "samples", "evaluate_every_n_steps", "model", "data")
#: Keys the converted config needs, and the TRL field that would give them.
NEEDED = {"model.model_path": "model_name_or_path", "data.train_data_path": "dataset_name",
          "data.judging.judgers": "reward_funcs"}


class _Loader(yaml.SafeLoader):
    """YAML as TRL's parser reads it: ``1e-6`` is a number (YAML 1.1 wants ``1.0e-6``)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)$"),
    list("-+0123456789."),
)


@dataclass
class Conversion:
    """An rlflow config converted from a TRL one: its keys (dotted: ``model.optim.lr``) and values, and the TRL
    fields not converted, by reason."""

    flat: dict[str, Any]
    skipped: dict[str, list[str]] = field(default_factory=dict)

    @property
    def config(self) -> dict[str, Any]:
        """The config as nested mappings, as a YAML config file holds it."""
        return nest(self.flat)

    def render(self, source: str, processes: int) -> str:
        """The YAML text: comments (the source, the values not converted, what is still to set), then the config."""
        lines = [f"# rlflow config from the TRL GRPO config {source} (rlflow config from-trl); the fields it leaves",
                 f"# out take TRL's defaults; batch sizes for {processes} training process"
                 f"{'es' if processes != 1 else ''} (--num-processes)."]
        lines += [f"# not converted: {', '.join(names)}: {reason}" for reason, names in self.skipped.items()]
        lines += [f"# to set: {key} (the TRL config has no {trl})" for key, trl in NEEDED.items()
                  if not any(k == key or k.startswith(key + ".") for k in self.flat)]
        body = yaml.safe_dump(self.config, sort_keys=False, default_flow_style=False, width=120, allow_unicode=True)
        return "\n".join(lines) + "\n" + body


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1}`` -> ``{"a": {"b": 1}}``, top-level keys in :data:`SECTIONS`' order."""
    out: dict[str, Any] = {}
    order = {name: i for i, name in enumerate(SECTIONS)}
    for key in sorted(flat, key=lambda k: order.get(k.split(".")[0], len(order))):
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = flat[key]
    return out


def read_trl_config(path: str) -> tuple[dict[str, Any], dict[str, int]]:
    """The fields of a TRL config file and the line of each; ConfigError naming the file where it is no mapping
    of fields."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read it: {exc}") from None
    try:
        node = yaml.compose(text, Loader=_Loader)
        values = yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        raise ConfigError(f"{where}: not valid YAML or JSON: {getattr(exc, 'problem', None) or exc}") from None
    if values is None:
        values, node = {}, None
    if not isinstance(values, dict) or any(not isinstance(k, str) for k in values):
        raise ConfigError(f"{path}: not a mapping of TRL config fields (field: value)")
    lines = {k.value: k.start_mark.line + 1 for k, _ in node.value} if node is not None else {}
    return values, lines


def near_names(name: str) -> str:
    """`` (did you mean x or y?)`` with the fields nearest ``name``, or nothing."""
    near = difflib.get_close_matches(name, list(FIELDS), n=3)
    return f" (did you mean {' or '.join(near)}?)" if near else ""


def read_values(given: dict[str, Any], where: Any) -> dict[str, Any]:
    """The given values as TRL reads them (numbers written as text are numbers...); ConfigError naming the field
    for one that is not of its type, or for an unknown field."""
    out = {}
    for name, value in given.items():
        spec = FIELDS.get(name)
        if spec is None:
            raise ConfigError(f"{where(name)}: unknown field {name!r}{near_names(name)}: not a field of TRL's "
                              "GRPOConfig, its trl grpo script's arguments or ModelConfig")
        if spec.convert is None:
            out[name] = value  # never converted: read only to see whether it differs from TRL's default
            continue
        if value is None and spec.default is not None and spec.value_type in (bool, int, float):
            raise ConfigError(f"{where(name)}: {name} must be a {spec.value_type.__name__}, got null")
        try:
            out[name] = coerce(value, spec.value_type)
        except ValueError as exc:
            raise ConfigError(f"{where(name)}: {name}: {exc}") from None
    return out


def differs(value: Any, default: Any) -> bool:
    """Whether a given value is not TRL's default (numbers compared as numbers)."""
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        try:
            return coerce(value, float) != default
        except ValueError:
            return True
    return value != default


def convert(given: dict[str, Any], processes: int = 1, where: Any = lambda name: "the TRL config") -> Conversion:
    """The rlflow config of the TRL fields ``given`` (read by :func:`read_trl_config`), for a TRL run of
    ``processes`` training processes. ``where(field)``: the place errors name (file and line)."""
    values = read_values(given, where)
    run = TrlRun(values, {name: spec.default for name, spec in FIELDS.items()}, processes)
    flat: dict[str, Any] = {}
    origin: dict[str, str] = {}
    skipped: dict[str, list[str]] = {}
    for name, spec in FIELDS.items():
        if spec.convert is None:
            if run.is_set(name) and differs(values[name], spec.default):
                skipped.setdefault(spec.note, []).append(name)
            continue
        try:
            out = spec.convert(run[name], run)
        except NotConverted as exc:
            skipped.setdefault(str(exc), []).append(name)
            continue
        except RefusedByTRL as exc:  # TRL would not start either
            raise ConfigError(f"{where(name)}: {exc}") from None
        except (TypeError, ValueError, ArithmeticError, AttributeError, KeyError) as exc:
            raise ConfigError(f"{where(name)}: {name}={run[name]!r}: {exc}") from None
        for key, value in out.items():
            if key in flat and flat[key] != value:
                raise ConfigError(f"{where(name)}: {name} and {origin[key]} give {key} two values, {value!r} and "
                                  f"{flat[key]!r}")
            flat[key] = value
            origin.setdefault(key, name)
    return Conversion(flat, skipped)


def from_trl(path: str, processes: int = 1) -> str:
    """The rlflow config (YAML text) of the TRL config file ``path``."""
    given, lines = read_trl_config(path)
    conversion = convert(given, processes, lambda name: f"{path}:{lines[name]}" if name in lines else path)
    return conversion.render(path, processes)


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="rlflow config", description="Write rlflow configs from other trainers' "
                                  "configs.")
    commands = top.add_subparsers(dest="command", metavar="COMMAND")
    from_trl_parser = commands.add_parser(
        "from-trl", help="an rlflow config (YAML, on stdout) from a TRL GRPO config",
        description="Reads the YAML or JSON file trl grpo --config takes (GRPOConfig's fields, the script's "
        "dataset_name, dataset_config, dataset_train_split and reward_funcs, model_name_or_path) and prints the rlflow "
        "config of the same run. Fields the file leaves out take TRL's defaults; values with no mechanical rlflow "
        "counterpart are listed at the top as '# not converted: field: reason'. The guide's 'Coming from TRL' page "
        "lists every field.",
        epilog="example: rlflow config from-trl grpo_config.yaml > rlflow.yaml && rlflow fit --config rlflow.yaml")
    from_trl_parser.add_argument("file", metavar="FILE",
                                 help="the TRL config: YAML or JSON, as trl grpo --config reads it")
    from_trl_parser.add_argument("--num-processes", type=int, default=1, metavar="N",
                                 help="training processes the TRL run had (its batch sizes are per device; default 1)")
    return top


def main(argv: list[str] | None = None) -> int:
    """``rlflow config ...``; the exit code."""
    cli = parser()
    args = cli.parse_args(argv)
    if args.command is None:
        cli.print_help()
        return 2
    if args.num_processes < 1:
        cli.error(f"--num-processes must be >= 1, got {args.num_processes}")
    try:
        text = from_trl(args.file, args.num_processes)
    except ConfigError as exc:
        print(f"rlflow: error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(text)
    return 0
