"""The groups of ``data.*`` settings: one dataclass per concern, each the one home of its settings.

``rlflow fit --help`` shows each field's docstring under its group (``--data.eval.k``); each group checks its
own values when it is built, so a wrong value is one :class:`~rlflow.config_error.ConfigError` naming its full key.
From Python a group is given as the dataclass or as a mapping of its fields
(:meth:`~rlflow.config_checks.SettingsGroup.coerce`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from rlflow.config_checks import Rule, SettingsGroup, at_least, greater_than, interval, one_of
from rlflow.config_error import ConfigError
from rlflow.judgers.base import Judger


@dataclass(frozen=True)
class PromptSettings(SettingsGroup):
    """``data.prompts``: how dataset rows become the prompts the policy sees."""

    key: ClassVar[str] = "data.prompts"
    rules: ClassVar[dict[str, Rule]] = {}

    system_prompt: str | None = None
    """If set, replaces (or adds) the system message of every chat prompt."""
    template: str | None = None
    """If set, plain-string prompts become ``template.format(prompt=..., **columns)``."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra keyword arguments for the tokenizer's chat template (e.g. ``enable_thinking: false``)."""


@dataclass(frozen=True)
class EvalSettings(SettingsGroup):
    """``data.eval``: how evaluation prompts (``data.eval_data_path``) are sampled and scored."""

    key: ClassVar[str] = "data.eval"
    rules: ClassVar[dict[str, Rule]] = {"temperature": at_least(0.0), "batch_size": at_least(1), "k": at_least(1)}

    temperature: float = 0.0
    """Sampling temperature of evaluation rollouts; 0 is greedy."""
    batch_size: int = 64
    """Prompts per evaluation batch."""
    pass_threshold: float = 1.0
    """A completion counts as correct when its reward is at least this (``eval/accuracy``, ``pass@k``; also the
    bar of ``data.filtering.skip_solved``)."""
    k: int = 1
    """Completions per prompt: 1 reports ``eval/accuracy``; k > 1 samples at ``temperature`` (then > 0) and also
    reports ``eval/pass@k`` (and ``pass@2``, ``@4``, ... below k) and ``eval/maj@k`` (majority vote, from judgers
    that state answers)."""

    def check(self) -> None:
        if self.k > 1 and self.temperature == 0.0:
            raise ConfigError(f"data.eval.k={self.k} with data.eval.temperature=0: k > 1 greedy completions would all "
                              "be identical; set data.eval.temperature > 0 (e.g. 0.6) or data.eval.k=1")


@dataclass(frozen=True)
class JudgingSettings(SettingsGroup):
    """``data.judging``: which judgers score each ``data_source``, and how their rewards combine."""

    key: ClassVar[str] = "data.judging"
    rules: ClassVar[dict[str, Rule]] = {"timeout": greater_than(0.0, optional=True),
                                         "max_failure_rate": interval(0.0, 1.0, optional=True),
                                         "isolation": one_of("process", "thread")}

    judgers: dict[str, str | Judger | list[str | Judger]] | None = None
    """Judgers per ``data_source``: a short name of the ``rlflow.judgers`` group, an import path (a TRL-style reward
    function), ``class_path``/``init_args`` (``--data.judging.judgers.help gsm8k`` lists a judger's options), or a
    list of these; ``*`` catches every source. None: ``{openai/gsm8k: gsm8k}``."""
    weights: dict[str, float] | None = None
    """Weight of each judger (by name) in the summed reward; default 1.0 each."""
    timeout: float | None = 60.0
    """Seconds one judger may take on one batch; past it (or if it raises) its samples get no reward from it and
    are counted in ``judger/failures``. None waits forever."""
    isolation: str = "process"
    """Where user-written synchronous judgers run (TRL-style reward functions, plugins' judgers, the ``function``
    judger's function): ``process``: each in a worker process, which ``timeout`` kills together with every process
    the judger started (counted in ``judger/killed_workers``; the next batch gets a fresh worker); ``thread``: in a
    thread of the trainer, which ``timeout`` abandons (it runs on, counted in ``judger/abandoned_threads``).
    rlflow's own judgers, ``async def`` ones and those taking ``environments`` run in the trainer either way."""
    max_failure_rate: float | None = None
    """Share of a rollout step's samples one judger may fail on (raise, time out) while the run goes on; past it
    the run stops at that step, naming the judger, its exception and the keywords it was given. None: stop only
    when a judger fails on every one of its samples (a wrong signature, a missing column); 0: on any failure."""
    overlap: bool = True
    """With a backend that streams finished groups (``engine``), judge them in a background thread while the rest
    of the batch is still generating (same rewards and metrics as judging after generation). Pays for slow judgers
    (remote services, math verification); a judger of microseconds a sample is better judged after generation,
    since its thread contends with the decode loop for Python's interpreter lock."""


    def judger_specs(self) -> dict[str, Any]:
        """The ``judgers`` mapping, with the default where none is set."""
        return self.judgers if self.judgers is not None else {"openai/gsm8k": "gsm8k"}


@dataclass(frozen=True)
class FilteringSettings(SettingsGroup):
    """``data.filtering``: which groups and prompts are worth training on."""

    key: ClassVar[str] = "data.filtering"
    rules: ClassVar[dict[str, Rule]] = {"max_rounds": at_least(1)}

    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: drop groups whose rewards all agree (no learning signal) and sample more prompts
    until the batch is full again."""
    max_rounds: int = 3
    """With dynamic sampling, most generation rounds per rollout step (the first included); a batch still short
    after them is topped up with dropped groups (advantage 0)."""
    skip_solved: bool = False
    """Leave out of later epochs the prompts whose last group was solved (every reward at least
    ``data.eval.pass_threshold``), as Skywork-OR1 and POLARIS filter by pass rate: such a group has zero
    advantages and costs a rollout. One training source only (not a weighted mix)."""



@dataclass(frozen=True)
class PipelineSettings(SettingsGroup):
    """``data.pipeline``: where and when rollouts are generated (see the guide's pipelined-generation page)."""

    key: ClassVar[str] = "data.pipeline"
    rules: ClassVar[dict[str, Rule]] = {"max_staleness": at_least(0), "stale_policy": one_of("drop", "regenerate"),
                                         "generator_threads": at_least(1), "partial_swap_step": at_least(0)}

    max_staleness: int = 0
    """0: the strictly on-policy loop. N > 0: generate the next rollout step in a separate process while the
    trainer updates on this one, and train on an experience only while ``trained version - sampling version <= N``
    policy versions (the one-step pipeline's staleness is ``model.update.optimizer_steps x
    model.update.num_iterations``); turns the rollout importance-sampling correction on unless
    ``model.rollout_correction.mode: off``."""
    stale_policy: str = "regenerate"
    """With ``max_staleness > 0``: experience beyond the bound is ``drop``-ped or ``regenerate``-d from the current
    weights (counted either way)."""
    generator_threads: int = 1
    """Torch threads of the generator process (pipelined or split rollouts)."""
    partial_rollouts: bool = False
    """With ``max_staleness > 0`` (engine backend, one process): the look-ahead job takes the trainer's next weights
    at decode iteration ``partial_swap_step`` and continues its unfinished completions under them from their KV
    caches, each token stamped with the version that sampled it; staleness is the oldest token's."""
    partial_swap_step: int = 0
    """The decode iteration of that swap (0: half of ``data.sampling.max_tokens``)."""
    lend_cores: bool = True
    """With ``max_staleness > 0`` on a CPU: the backward pass and evaluation take back the generator process's
    cores while it waits between two decode iterations (engine backend). Right where training is the larger part
    of a step; ``false`` where generation is. The threads depend on the phase, not on timing: runs stay
    reproducible."""
    split_rollout: bool = False
    """With ``max_staleness: 0``, the engine backend and a policy on a CPU (one process, more than
    ``generator_threads`` torch threads): the generator process decodes the second half of each rollout's prompts
    while the trainer decodes the first half, both from the trainer's random streams, so the completions are those
    of one process. Right for small models, whose decode steps leave a second core idle. Ignored (with a log line)
    when pipelined or multi-turn."""



@dataclass(frozen=True)
class MultiTurnSettings(SettingsGroup):
    """``data.multiturn``: tool calls and environments, which make rollouts multi-turn."""

    key: ClassVar[str] = "data.multiturn"
    rules: ClassVar[dict[str, Rule]] = {"max_turns": at_least(1), "tool_timeout": greater_than(0.0, optional=True),
                                         "tool_isolation": one_of("process", "thread")}

    tools: list[Any] | None = None
    """Tools the policy may call, each an import path (``my_pkg.tools:search``, a TRL-style typed function with a
    Google docstring) or a short name of the ``rlflow.tools`` group (``calculator``, ``python``); from Python, the
    functions themselves. Their schemas reach the chat template, and ``data.sampling.max_tokens`` becomes the
    budget of the whole trajectory."""
    parser: str = "hermes"
    """How tool calls are found in a completion: a short name of ``rlflow.tool_parsers`` (``hermes``:
    ``<tool_call>{json}</tool_call>``) or an import path."""
    tool_timeout: float | None = 30.0
    """Seconds one tool call may take; past it (or if the tool raises, or gets bad arguments) the model gets an
    error message as the tool's result, counted in ``tools/failure_frequency``."""
    tool_isolation: str = "process"
    """Where a user's plain tools run: ``process``: in worker processes, which ``tool_timeout`` kills together with
    every process the call started; ``thread``: in threads of the trainer, which ``tool_timeout`` abandons.
    ``async def`` tools and rlflow's own (``calculator``; ``python`` runs in its sandbox) run in the trainer either
    way."""
    environment: str | dict[str, Any] | None = None
    """A multi-turn environment (``rlflow.environments`` short name, import path or ``class_path``/``init_args``),
    one instance per trajectory."""
    environment_factory: str | dict[str, Any] | None = None
    """TRL's ``environment_factory``: an environment class written for ``trl.GRPOTrainer`` (import path
    ``my_pkg.envs:MyEnv`` or ``class_path``/``init_args``; from Python, the class or a function returning an
    instance). Its public methods are tools, ``reset(**row)`` starts each trajectory, one instance per trajectory;
    judgers get the instances as ``environments``. Not together with ``environment``."""
    max_turns: int = 4
    """Most model turns per trajectory."""
    max_tool_output: int = 4096
    """Characters kept of a tool result's text (and of each text of an environment's observation); the rest is cut,
    with a line saying how many characters were cut. Cut where the tool ran (in its worker process with
    ``tool_isolation: process``), so a tool returning megabytes cannot fill the trainer's memory. Tokens inserted
    also count in ``data.sampling.max_tokens``, the trajectory's budget."""

    def check(self) -> None:
        if self.environment is not None and self.environment_factory is not None:
            from rlflow.environments.trl_factory import BOTH_ENVIRONMENTS

            raise ConfigError(BOTH_ENVIRONMENTS)
        if isinstance(self.max_tool_output, bool) or not isinstance(self.max_tool_output, int) or \
                self.max_tool_output < 1:
            raise ConfigError(f"data.multiturn.max_tool_output must be a whole number of characters >= 1, got "
                              f"{self.max_tool_output!r}")

    @property
    def enabled(self) -> bool:
        """Whether rollouts are multi-turn (tools, an environment or an environment factory are set)."""
        return bool(self.tools) or self.environment is not None or self.environment_factory is not None
