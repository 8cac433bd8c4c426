"""Judgers turn completions into rewards; each registers under the ``rlflow.judgers`` entry-point group."""

from rlflow.judgers.base import Judger, completion_text
from rlflow.judgers.gsm8k import GSM8KJudger
from rlflow.judgers.runner import JudgerRunner, JudgeResult

__all__ = ["Judger", "GSM8KJudger", "JudgerRunner", "JudgeResult", "completion_text"]
