"""``rlflow plugins``: every installed plugin per entry-point group, with its distribution and version."""

from __future__ import annotations

import argparse

from rlflow import registry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlflow plugins", description=__doc__)
    parser.add_argument("--group", choices=registry.GROUPS, help="show one group only")
    args = parser.parse_args(argv)
    for group in [args.group] if args.group else registry.GROUPS:
        print(f"{group}:")
        plugins = registry.discover(group)
        if not plugins:
            print("  (none)")
        width = max((len(name) for name in plugins), default=0)
        for name in sorted(plugins):
            info = plugins[name]
            print(f"  {name:<{width}}  {info.value}  [{info.distribution} {info.version}]")
    return 0
