"""Judgers turn completions into rewards; each registers under the ``rlflow.judgers`` entry-point group."""

from rlflow.judgers.base import Judger, completion_text
from rlflow.judgers.function import FunctionJudger
from rlflow.judgers.gsm8k import GSM8KJudger
from rlflow.judgers.math_verify import MathJudger
from rlflow.judgers.overlong import OverlongJudger
from rlflow.judgers.remote import RemoteJudger
from rlflow.judgers.reward_model import RewardModelJudger
from rlflow.judgers.runner import JudgeResult, JudgerRunner
from rlflow.judgers.think_format import ThinkFormatJudger

__all__ = [
    "Judger", "FunctionJudger", "GSM8KJudger", "MathJudger", "OverlongJudger", "RemoteJudger", "RewardModelJudger",
    "ThinkFormatJudger",
    "JudgerRunner", "JudgeResult", "completion_text",
]
