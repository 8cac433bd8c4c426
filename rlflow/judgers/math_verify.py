"""``math``: rewards a completion whose final answer is mathematically equal to the reference, via math-verify.

The semantics are TRL's ``accuracy_reward``: the reference is parsed with math-verify's default extraction
(LaTeX or a plain expression); the completion must give its answer in LaTeX, ``\\boxed{...}`` tried first, with
no anchor-less guessing; the two are compared symbolically (``\\frac{1}{2}`` equals ``0.5``). A reference that
cannot be parsed gives ``None`` (the sample is skipped, not punished). The reference comes from the
``solution`` column (TRL's name) or ``ground_truth`` (XTuner's ``reward_model.ground_truth``); a list holds
acceptable answers, any of which scores. Needs the optional extra: ``pip install 'rlflow[math]'``.
Simplification: math-verify's own timeouts use ``signal.alarm``, which only works on the main thread; off it
(rlflow runs plain judgers in a thread) they are off, as in TRL, and the runner's ``data.judging.timeout`` bounds
the call instead.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from rlflow.judgers.base import Judger

MISSING_EXTRA = (
    "the 'math' judger needs the math-verify package: pip install 'rlflow[math]' (or pip install math-verify)"
)


class MathJudger(Judger):
    """Symbolic answer checking for math datasets (boxed answers, LaTeX), as TRL's ``accuracy_reward``.

    Args:
        correct_score: Reward of a completion whose answer equals the reference.
        wrong_score: Reward of a completion whose answer is wrong or missing.
        parsing_timeout: Seconds math-verify may spend parsing one string (main thread only).
        verify_timeout: Seconds math-verify may spend comparing one pair (main thread only).
    """

    name = "math"
    required_columns = ("ground_truth",)

    def __init__(
        self, correct_score: float = 1.0, wrong_score: float = 0.0, parsing_timeout: int = 10, verify_timeout: int = 5
    ) -> None:
        try:
            from latex2sympy2_extended import NormalizationConfig
            from math_verify import LatexExtractionConfig, parse, verify
        except ImportError as exc:
            raise ImportError(MISSING_EXTRA) from exc
        self._parse, self._verify = parse, verify
        self.answer_config = [
            LatexExtractionConfig(
                normalization_config=NormalizationConfig(units=True),
                boxed_match_priority=0,  # \boxed{} first
                try_extract_without_anchor=False,
            )
        ]
        self.correct_score = float(correct_score)
        self.wrong_score = float(wrong_score)
        self.parsing_timeout = parsing_timeout
        self.verify_timeout = verify_timeout

    def _timeouts(self) -> tuple[int | None, int | None]:
        """math-verify's parsing and verifying timeouts: off outside the main thread (they use ``signal.alarm``)."""
        if threading.current_thread() is threading.main_thread():
            return self.parsing_timeout, self.verify_timeout
        # math-verify warns on every call that its timeout is off; that is intended here
        logging.getLogger("math_verify.parser").setLevel(logging.ERROR)
        logging.getLogger("math_verify.grader").setLevel(logging.ERROR)
        return None, None

    def _extract(self, completion: str, parsing_timeout: int | None) -> list:
        """math-verify's parse of the completion's answer (``[sympy form, matched string]``; empty: none found)."""
        return self._parse(completion, extraction_config=self.answer_config, extraction_mode="first_match",
                           parsing_timeout=parsing_timeout)

    def answer(self, completion: str) -> str | None:
        """The answer the completion states, as math-verify's parsed form printed (``1/2`` for ``\\frac{1}{2}``), for
        ``eval/maj@k``; forms math-verify does not bring to one (``0.5`` against ``1/2``) vote apart."""
        parsed = self._extract(completion, self._timeouts()[0])
        return str(parsed[0]) if parsed else None

    def score(self, completion: str, ground_truth: Any = None, solution: Any = None, **_: Any) -> float | None:
        reference = solution if solution is not None else ground_truth
        if reference is None:
            raise ValueError("the math judger needs a 'solution' or 'ground_truth' column (reward_model.ground_truth)")
        parsing_timeout, verify_timeout = self._timeouts()
        references = reference if isinstance(reference, (list, tuple)) else [reference]  # acceptable answers
        golds = [g for g in (self._parse(str(r), parsing_timeout=parsing_timeout) for r in references) if g]
        if not golds:
            return None
        answer = self._extract(completion, parsing_timeout)
        correct = any(self._verify(gold, answer, timeout_seconds=verify_timeout) for gold in golds)
        return self.correct_score if correct else self.wrong_score
