"""The built-in ``calculator`` tool: arithmetic on numbers, evaluated by walking the expression's syntax tree.

Safe by construction: the expression is parsed with :mod:`ast` and only number literals, ``+ - * / // % **``
and unary ``+``/``-`` are evaluated; names, calls, attributes and everything else are refused. Exponents are
capped (``|exponent| <= 100``, base up to 1e6 for integer powers) so ``9**9**9`` cannot eat the CPU.
"""

from __future__ import annotations

import ast
import operator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (abs(right) > 100 or abs(left) > 1e6):
            raise ValueError("exponent or base too large")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element: {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, with numbers, + - * / // % ** and parentheses, e.g. "123 * 456".
    """
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval"))
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from exc
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)
