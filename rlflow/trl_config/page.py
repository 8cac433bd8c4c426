"""The field tables of ``docs/from_trl.md``, written from :data:`rlflow.trl_config.fields.FIELDS`: one table per
topic, a row per field (fields that share their keys and note share a row), between two marker comments of the
page; the rest of the page is written by hand.

    python -m rlflow.trl_config.page           # rewrite the tables
    python -m rlflow.trl_config.page --check   # exit 1 if the page's tables are not what the table gives
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlflow.trl_config.fields import FIELDS, TOPICS, Field

PAGE = Path(__file__).resolve().parents[2] / "docs" / "from_trl.md"
BEGIN = "<!-- field tables: written by python -m rlflow.trl_config.page from rlflow/trl_config/fields.py -->"
END = "<!-- end of the field tables -->"


def rows(topic: str) -> list[tuple[list[str], Field]]:
    """The fields of ``topic`` in the table's order, consecutive fields with the same keys and note together."""
    out: list[tuple[list[str], Field]] = []
    for name, spec in FIELDS.items():
        if spec.topic != topic:
            continue
        if out and (out[-1][1].keys, out[-1][1].note) == (spec.keys, spec.note):
            out[-1][0].append(name)
        else:
            out.append(([name], spec))
    return out


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def tables() -> str:
    """The Markdown of every topic's table (without the markers)."""
    parts = []
    for topic in TOPICS:
        lines = [f"### {topic}", "", "| TRL | rlflow | difference, or why there is none |", "| --- | --- | --- |"]
        for names, spec in rows(topic):
            keys = ", ".join(f"`{k}`" for k in spec.keys) or "none"
            lines.append(f"| {', '.join(f'`{n}`' for n in names)} | {keys} | {_cell(spec.note)} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def with_tables(text: str) -> str:
    """``text`` (the page) with the tables between its markers replaced; ValueError if it lacks them."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"the page has no single pair of markers {BEGIN!r} ... {END!r}")
    head, rest = text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n\n{tables()}\n\n{END}{tail}"


def main(argv: list[str] | None = None, page: Path = PAGE) -> int:
    parser = argparse.ArgumentParser(prog="python -m rlflow.trl_config.page", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page's tables are stale")
    args = parser.parse_args(argv)
    text = page.read_text(encoding="utf-8")
    wanted = with_tables(text)
    if args.check:
        if wanted != text:
            print(f"{page}: the field tables are stale: run python -m rlflow.trl_config.page", file=sys.stderr)
            return 1
        return 0
    page.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
