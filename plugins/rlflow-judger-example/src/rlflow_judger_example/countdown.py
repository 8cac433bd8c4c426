"""Scores the Countdown numbers game: reach ``target`` with the given ``numbers`` and + - * / and brackets.

The completion's answer is the last ``<answer>...</answer>`` block (TinyZero's format), e.g.
``<answer>(25 - 5) * 3</answer>`` for numbers [3, 5, 25] and target 60. It is parsed with Python's ``ast``
(never ``eval``): only numbers, the four operators, unary minus and brackets are allowed, and it is evaluated
in exact fractions, so ``1 / 3 * 3`` is exactly 1. Each given number must be used exactly once (or at most
once with ``use_all_numbers=False``). Unlike TinyZero's ``compute_score``, no floating-point tolerance is
needed and no code is ever executed.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from fractions import Fraction
from typing import Any

from rlflow.judgers import Judger

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
MAX_CHARS = 200  # longer "equations" are not Countdown answers (and would be slow to parse)
_OPS = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
}


class NotAnEquation(ValueError):
    """The answer uses something other than numbers, + - * /, unary minus and brackets, or divides by zero."""


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """The exact value of ``expression`` and the integers it uses, in order; NotAnEquation if it is not one."""
    if len(expression) > MAX_CHARS:
        raise NotAnEquation(f"longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise NotAnEquation(f"not an arithmetic expression: {exc.msg}") from exc
    used: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise NotAnEquation("division by zero")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        raise NotAnEquation(f"{type(node).__name__} is not allowed (only integers, + - * /, brackets)")

    return walk(tree.body), used


class CountdownJudger(Judger):
    """Rewards a correct Countdown equation; a well-formed but wrong one gets ``format_score``.

    Args:
        score: Reward of an equation that uses the numbers correctly and equals the target.
        format_score: Reward of an ``<answer>`` that is an equation but wrong (TinyZero's 0.1).
        use_all_numbers: Every number must be used exactly once (TinyZero); otherwise at most once.
    """

    name = "countdown"
    required_columns = ("target", "numbers")

    def __init__(self, score: float = 1.0, format_score: float = 0.1, use_all_numbers: bool = True) -> None:
        self.correct_score = float(score)
        self.format_score = float(format_score)
        self.use_all_numbers = use_all_numbers

    def uses_numbers_correctly(self, used: list[int], numbers: list[int]) -> bool:
        used_count, given = Counter(used), Counter(numbers)
        if self.use_all_numbers:
            return used_count == given
        return all(used_count[n] <= given[n] for n in used_count)

    def score(
        self,
        completion: str,
        target: Any = None,
        numbers: Any = None,
        nums: Any = None,
        ground_truth: Any = None,
        **_: Any,
    ) -> float:
        if isinstance(ground_truth, dict):  # TinyZero keeps both in reward_model.ground_truth
            target = ground_truth.get("target", target)
            numbers = ground_truth.get("numbers", numbers)
        numbers = numbers if numbers is not None else nums
        if target is None or numbers is None:
            raise ValueError("the countdown judger needs the columns 'target' and 'numbers' (or 'nums')")
        answers = ANSWER.findall(completion)
        if not answers:
            return 0.0
        try:
            value, used = evaluate(answers[-1])
        except NotAnEquation:
            return 0.0
        if not self.uses_numbers_correctly(used, [int(n) for n in numbers]):
            return self.format_score
        return self.correct_score if value == Fraction(target) else self.format_score
