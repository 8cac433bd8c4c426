"""GSM8K rule-based judger, with the exact semantics of verl's and XTuner's ``gsm8k`` reward.

Only the last 300 characters of the completion are searched (a long completion's answer is at its end, and
the regex stays cheap); the strict pattern ``#### <number>`` must appear with one space; the last match wins;
``,`` and ``$`` are removed; the result is compared with ``ground_truth`` as an exact string. A list
``ground_truth`` holds acceptable answers: any of them scores (verl would compare with the list's ``str``).
"""

from __future__ import annotations

import re
from typing import Any

from rlflow.judgers.base import Judger

SOLUTION_CLIP_CHARS = 300
STRICT_PATTERN = re.compile(r"#### (\-?[0-9\.\,]+)")


def extract_answer(text: str) -> str | None:
    """The final ``#### <number>`` answer of ``text`` (last match in its last 300 characters), or None."""
    matches = STRICT_PATTERN.findall(text[-SOLUTION_CLIP_CHARS:])
    if not matches:
        return None
    return matches[-1].replace(",", "").replace("$", "")


class GSM8KJudger(Judger):
    """Scores a completion ``score`` when its ``#### <number>`` answer equals ``ground_truth`` exactly.

    ``format_score`` is given when an answer is found but wrong, ``missing_score`` when none is found
    (verl's defaults: 1.0, 0.0, 0.0).
    """

    name = "gsm8k"
    required_columns = ("ground_truth",)

    def __init__(self, score: float = 1.0, format_score: float = 0.0, missing_score: float = 0.0) -> None:
        self.correct_score = float(score)
        self.format_score = float(format_score)
        self.missing_score = float(missing_score)

    def answer(self, completion: str) -> str | None:
        """The ``#### <number>`` answer the completion states (what :meth:`score` compares), for ``eval/maj@k``."""
        return extract_answer(completion)

    def score(self, completion: str, ground_truth: Any = None, **_: Any) -> float:
        if ground_truth is None:
            raise ValueError("the gsm8k judger needs a 'ground_truth' column (reward_model.ground_truth)")
        answer = extract_answer(completion)
        if answer is None:
            return self.missing_score
        truths = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
        return self.correct_score if answer in {truth_text(t) for t in truths} else self.format_score


def truth_text(truth: Any) -> str:
    """A ground truth as the answer it must equal: written as :func:`extract_answer` writes answers (no thousands
    commas or ``$``), a whole float as an integer (``72.0`` from a pandas column is ``72``)."""
    if isinstance(truth, float) and truth.is_integer():
        return str(int(truth))
    return str(truth).strip().replace(",", "").replace("$", "")
