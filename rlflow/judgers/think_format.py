"""``think_format``: rewards a completion laid out as ``<think>reasoning</think>`` followed by the answer.

Like TRL's ``think_format_reward`` (the completion starts with ``<think>``, which is closed), but stricter:
exactly one opening and one closing tag, and a non-empty answer after the closing tag (unless
``require_answer`` is off). Leading whitespace is allowed. For chat templates that already open the think
block in the prompt (DeepSeek-R1's, Qwen3's thinking mode) set ``think_in_prompt``: the completion then has
no opening tag and must contain one closing tag.
"""

from __future__ import annotations

from typing import Any

from rlflow.judgers.base import Judger


class ThinkFormatJudger(Judger):
    """Format reward for reasoning models: one think block, closed, then an answer.

    Args:
        score: Reward of a well-formed completion.
        wrong_score: Reward of any other completion.
        require_answer: The text after the closing tag must be non-empty (not only whitespace).
        think_in_prompt: The prompt already ends with the opening tag, so the completion must not repeat it.
        open_tag: The opening tag.
        close_tag: The closing tag.
    """

    name = "think_format"

    def __init__(
        self,
        score: float = 1.0,
        wrong_score: float = 0.0,
        require_answer: bool = True,
        think_in_prompt: bool = False,
        open_tag: str = "<think>",
        close_tag: str = "</think>",
    ) -> None:
        if not open_tag or not close_tag:
            raise ValueError("think_format: open_tag and close_tag must be non-empty")
        self.good, self.bad = float(score), float(wrong_score)
        self.require_answer = require_answer
        self.think_in_prompt = think_in_prompt
        self.open_tag, self.close_tag = open_tag, close_tag

    def well_formed(self, text: str) -> bool:
        """Whether ``text`` is one think block followed by an answer."""
        body = text.lstrip()
        if not self.think_in_prompt:
            if not body.startswith(self.open_tag):
                return False
            body = body[len(self.open_tag):]
        if self.open_tag in body or body.count(self.close_tag) != 1:
            return False
        answer = body.split(self.close_tag, 1)[1]
        return bool(answer.strip()) or not self.require_answer

    def score(self, completion: str, **_: Any) -> float:
        return self.good if self.well_formed(completion) else self.bad
