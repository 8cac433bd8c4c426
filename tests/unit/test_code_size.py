"""Size rule for rlflow's code: no class longer than 400 lines, no function or method longer than 80, unless it
carries a one-line reason.

A definition's length is ``end_lineno - lineno + 1`` of its ``ast`` node: from its ``def``/``class`` line (its
decorators excluded) to its last line, docstring included. The reason is a comment ``# size: <reason>`` on the
``def``/``class`` line or on the line right above it; it is meant for what is long but linear (an ``__init__``
whose length is its documented arguments), not for a tangle, which is split into named steps instead.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import rlflow

MAX_CLASS_LINES = 400
MAX_FUNCTION_LINES = 80
REASON = re.compile(r"#\s*size:\s*\S")


def oversized(source: str, where: str = "<source>") -> list[str]:
    """One line per class or function of ``source`` over its limit without a ``# size:`` reason."""
    lines = source.splitlines()
    found: list[str] = []

    def has_reason(lineno: int) -> bool:
        return any(REASON.search(lines[i - 1]) for i in (lineno, lineno - 1) if 1 <= i <= len(lines))

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{scope}{child.name}"
                is_class = isinstance(child, ast.ClassDef)
                limit = MAX_CLASS_LINES if is_class else MAX_FUNCTION_LINES
                length = child.end_lineno - child.lineno + 1
                if length > limit and not has_reason(child.lineno):
                    kind = "class" if is_class else "function"
                    found.append(f"{where}:{child.lineno} {kind} {name} is {length} lines (limit {limit})")
                visit(child, f"{name}.")
            else:
                visit(child, scope)

    visit(ast.parse(source), "")
    return found


def test_no_class_or_function_of_rlflow_is_over_its_size_without_a_reason():
    package = Path(rlflow.__file__).resolve().parent
    found = []
    for path in sorted(package.rglob("*.py")):
        found += oversized(path.read_text(encoding="utf-8"), str(path.relative_to(package.parent)))
    assert not found, (
        "split these into named steps (a class by concept into modules), or give a one-line reason as a comment "
        "`# size: <reason>` on the def/class line or the line above it:\n" + "\n".join(found)
    )


def test_the_rule_counts_from_the_def_line_and_takes_a_reason_on_or_above_it():
    body = "".join(f"    x{i} = {i}\n" for i in range(79))
    assert oversized(f"@decorator\n@another\ndef f():\n{body}") == []  # 80 lines: decorators do not count
    long = f"def f():\n{body}    return x0\n"  # 81 lines
    assert oversized(long) == ["<source>:1 function f is 81 lines (limit 80)"]
    assert oversized("# size: a linear list of documented arguments\n" + long) == []
    assert oversized(long.replace("def f():", "def f():  # size: one table, row after row")) == []
    assert oversized("# size:\n" + long) != []  # a reason needs words
    assert oversized("# size: too far above\n\n" + long) != []
    nested = "class C:\n" + "".join("    " + line + "\n" for line in long.splitlines())
    assert oversized(nested) == ["<source>:2 function C.f is 81 lines (limit 80)"]
    big_class = "class C:\n" + "".join(f"    x{i} = {i}\n" for i in range(400))
    assert oversized(big_class) == ["<source>:1 class C is 401 lines (limit 400)"]
