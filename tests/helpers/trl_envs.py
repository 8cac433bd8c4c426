"""TRL-style environment classes (``environment_factory``'s contract) and reward functions reading ``environments``,
for the tests of :mod:`rlflow.environments.trl_factory`; written exactly as TRL's docs write them."""

from __future__ import annotations

import time
from pathlib import Path

from rlflow.tools.calculator import calculator as evaluate


class CalculatorEnv:
    """Counts the calculator calls of its trajectory and remembers the row it was reset with."""

    def __init__(self) -> None:
        self.calls = 0
        self.expressions: list[str] = []
        self.resets = 0
        self.ground_truth = None
        self.row: dict | None = None

    def reset(self, **kwargs) -> str | None:
        self.calls = 0
        self.expressions = []
        self.resets += 1
        self.ground_truth = kwargs.get("ground_truth")
        self.row = kwargs
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: The expression, e.g. "123*456".
        """
        self.calls += 1
        self.expressions.append(expression)
        return evaluate(expression)

    def get_reward(self) -> float:
        return 1.0 if self.calls else 0.0

    def _helper(self) -> None:  # private: not a tool
        raise AssertionError("not a tool")


class CounterEnv:
    """A step counter whose reset appends a hint to the prompt and whose tools include a failing, a hanging, an async
    and a static one."""

    def __init__(self, start: int = 0) -> None:
        self.start = start
        self.count = start
        self.seen: list[str] = []

    def reset(self, prompt, ground_truth=None) -> str:
        self.count = self.start
        self.seen = []
        return f" (start at {self.start}, answer {ground_truth})"

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.count += step
        self.seen.append(f"+{step}")
        return self.count

    async def double(self) -> int:
        """Double the counter (an async tool)."""
        self.count *= 2
        return self.count

    def explode(self, x: int) -> int:
        """Always raises.

        Args:
            x: Anything.
        """
        raise SystemExit(f"explode {x}")

    def stall(self, seconds: float) -> str:
        """Sleeps.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        self.seen.append("stalled")
        return "awake"

    @staticmethod
    def echo(text: str) -> str:
        """Repeat the text.

        Args:
            text: Anything.
        """
        return text

    @property
    def value(self) -> int:  # a property: not a tool
        return self.count


class NoToolsEnv:
    """Only ``reset``: the model would have nothing to call."""

    def reset(self, **kwargs) -> None:
        return None


class UntypedEnv:
    """A tool method without type hints: no JSON schema."""

    def reset(self, **kwargs) -> None:
        return None

    def guess(self, number):
        """Guess.

        Args:
            number: The guess.
        """
        return number


def tool_calls_reward(completions, environments, ground_truth, log_extra, **kwargs) -> list[float]:
    """TRL-style reward: the number of tool calls the completion's environment instance counted; logs the instances'
    state as columns of trajectories.jsonl."""
    log_extra("env_calls", [env.calls for env in environments])
    log_extra("env_expressions", [list(env.expressions) for env in environments])
    log_extra("env_ground_truth", [env.ground_truth for env in environments])
    return [float(env.calls) for env in environments]


def names_environments(completions, environments) -> list[float]:
    """Takes no ``**kwargs``: gets ``environments`` because it names it."""
    return [float(len(environments))] * len(completions)


def no_environments(completions, ground_truth=None) -> list[float]:
    """Takes no ``**kwargs`` and names no ``environments``: must not get them."""
    return [0.0] * len(completions)


def build_tool_caller(model_dir: Path, data_dir: Path, steps: int = 60, n_train: int = 8) -> Path:
    """The tiny tool model (:mod:`rlflow.demo.tiny_tool_model`) after a short SFT on tool-calling examples only, so
    it calls the calculator on most prompts (copying the operands is not learned in so few steps), and its data."""
    import random

    from rlflow.demo.tiny_model import build_model, build_tokenizer, write_jsonl
    from rlflow.demo.tiny_tool_model import TOOL_TEMPLATE, Encoder, problems, rl_row, sft

    tokenizer = build_tokenizer()
    tokenizer.chat_template = TOOL_TEMPLATE
    model = build_model(tokenizer, 0)
    sft(model, Encoder(tokenizer), steps, 0, 1.0, batch_size=8, lr=1e-2)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rows = [rl_row(i, "train", a, b) for i, (a, b) in enumerate(problems(random.Random(7), n_train))]
    write_jsonl(data_dir / "train.jsonl", rows)
    return model_dir
