"""An example third-party rlflow judger package: the Countdown numbers game (TinyZero's task)."""

from rlflow_judger_example.countdown import CountdownJudger, evaluate

__all__ = ["CountdownJudger", "evaluate"]
__version__ = "0.1.0"
