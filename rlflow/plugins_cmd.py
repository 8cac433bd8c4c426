"""``rlflow plugins``: every installed plugin per entry-point group, with its distribution and version.

``--check`` also imports each plugin, so a broken one shows its error here rather than at training time. A
group whose plugins conflict (two distributions claiming one name) prints the error and the command exits 1.
"""

from __future__ import annotations

import argparse

from rlflow import registry


def check_usable(group: str, obj: object) -> None:
    """What ``rlflow fit`` also checks of a plugin before using it: a tool function's JSON schema (type hints and
    a docstring with an ``Args:`` section); a PluginError saying why not."""
    import inspect

    if group == "rlflow.tools" and inspect.isfunction(obj):
        from rlflow.config_error import ConfigError
        from rlflow.tools.base import tool_schema

        try:
            tool_schema(obj)
        except ConfigError as exc:
            raise registry.PluginError(str(exc).removeprefix("data.multiturn.tools: ")) from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlflow plugins", description=__doc__.split("\n")[0])
    parser.add_argument("--group", choices=registry.GROUPS, help="show one group only")
    parser.add_argument("--check", action="store_true", help="import every plugin and report the ones that fail")
    args = parser.parse_args(argv)
    status = 0
    for group in [args.group] if args.group else registry.GROUPS:
        print(f"{group}:")
        try:
            plugins = registry.discover(group)
        except registry.PluginError as exc:
            print(f"  ERROR: {exc}")
            status = 1
            continue
        if not plugins:
            print("  (none)")
        width = max((len(name) for name in plugins), default=0)
        for name in sorted(plugins):
            info = plugins[name]
            line = f"  {name:<{width}}  {info.distribution} {info.version}  ({info.value})"
            why = registry.conflict(group, name)
            if why is not None:
                line += f"\n    CONFLICT: {why}"
                status = 1
            elif args.check:
                try:
                    check_usable(group, registry.load(group, name))
                    line += "  ok"
                except registry.PluginError as exc:
                    line += f"\n    BROKEN: {exc}"
                    status = 1
            print(line)
    return status
