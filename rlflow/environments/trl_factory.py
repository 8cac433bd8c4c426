"""TRL's ``environment_factory`` contract: an environment class whose public methods are the model's tools.

A class written for ``trl.GRPOTrainer(environment_factory=MyEnv)`` runs unchanged when it is named in
``data.multiturn.environment_factory`` (an import path, ``my_pkg.envs:MyEnv``, or ``{class_path: ..., init_args:
{...}}``; from Python, the class or any callable that returns an instance). It is TRL 1.16's contract:

* **tools**: every public method of the class (``inspect.getmembers(cls, inspect.isfunction)``: plain and static
  methods whose name does not start with ``_``), except ``reset`` and ``get_reward``, is a tool. Its JSON schema comes
  from its type hints and Google-style docstring (transformers' ``get_json_schema``, the schema of
  ``data.multiturn.tools``); the schemas are rendered into every prompt beside those of ``data.multiturn.tools``. A
  class with no public method, without a callable ``reset``, or with a method whose schema cannot be built is refused
  before any model loads, in one line.
* **one instance per trajectory**: a trajectory's tool calls go to the methods of its own instance. Instances are
  pooled across rollouts as TRL pools them ("construct once, reset often"): a rollout of ``n`` trajectories takes the
  first ``n`` instances of the pool and creates more only when the pool is short. An instance one of whose tool calls
  timed out, or whose ``get_reward`` failed, leaves the pool (an abandoned call may still be changing it) and a new
  one takes its place.
* **reset**: before a trajectory's first turn, ``reset(**row)`` gets the dataset row: ``prompt`` and every other
  column (``ground_truth`` included), a deep copy, those it names where it takes no ``**kwargs``. It returns None
  or a string; a string is appended to the last user message of the prompt (to a plain-string prompt's text), which
  is then tokenized again for that trajectory. A ``reset`` that raises, or returns anything else, stops the run with
  one line naming the class and the row: it is a bug in the environment, as in TRL.
* **tool calls** run through :class:`~rlflow.tools.base.ToolRunner` like ``data.multiturn.tools``: with
  ``data.multiturn.tool_timeout``, every failure (an exception, ``SystemExit`` included, bad arguments, a timeout)
  becomes the tool message the model reads and is counted in ``tools/failure_frequency``. A plain method runs in a
  thread of the trainer (the instance lives there); an ``async def`` method on the tool runner's event loop.
* **get_reward** (optional): once the trajectory has ended, ``get_reward()`` gives its reward, the sample's
  ``env_reward`` column, which the ``env_reward`` judger turns into a reward (TRL adds it as a reward source of
  its own; in rlflow it is named in ``data.judging.judgers`` like every other). One that raises or times out gives
  None, counted in ``env/failures``; one that returns something other than a number or None stops the run.
* **environments**: every judger that takes the keyword (or ``**kwargs``) gets ``environments``, the instances in
  completion order (:func:`rlflow.judgers.context.environments_of`), so a reward function reads their state.

Simplifications: ``reset`` and the factory run on the rollout's thread, with no timeout (a hanging ``reset`` hangs
the run, as in TRL); a method whose call timed out keeps running in its abandoned thread; TRL's mapping of several
named environments (``environment_factory={"a": A, "b": B}``, routed by an ``environment`` column) is not supported;
a row with images cannot have a ``reset`` observation appended (its prompt tokens come from the processor).
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import functools
import inspect
import logging
import numbers
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlflow import registry
from rlflow.config_error import ConfigError
from rlflow.judgers.context import accepted_keywords, select_keywords
from rlflow.tools.base import Tool, ToolRunner

KEY = "data.multiturn.environment_factory"
#: The one line refusing both kinds of environment at once.
BOTH_ENVIRONMENTS = ("data.multiturn.environment and data.multiturn.environment_factory are both set; set one "
                     "(environment: an rlflow reset/step environment; environment_factory: a TRL environment class "
                     "whose public methods are tools)")
#: Methods of TRL's contract that are not tools.
RESERVED = ("reset", "get_reward")
log = logging.getLogger(__name__)


def tool_names(cls: type) -> list[str]:
    """The names of the tool methods of environment class ``cls``, TRL's rule: plain and static methods whose name
    does not start with ``_``, except :data:`RESERVED` (properties and class methods are not tools)."""
    return [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
            if name not in RESERVED and not name.startswith("_")]


def load_factory(spec: Any) -> Callable[[], Any]:
    """The callable that makes an instance: from an import path, a ``class_path``/``init_args`` mapping (also as
    YAML text) or a callable."""
    if isinstance(spec, str) and spec.lstrip().startswith("{"):
        import yaml

        spec = yaml.safe_load(spec)
    if isinstance(spec, str):
        return registry.import_path(spec)
    if isinstance(spec, Mapping):
        unknown = set(spec) - {"class_path", "init_args"}
        if not isinstance(spec.get("class_path"), str) or unknown:
            raise ConfigError(f"{KEY} must be an import path or a mapping with 'class_path' (and optionally "
                              f"'init_args'); got keys {sorted(spec)}")
        init_args = spec.get("init_args") or {}
        if not isinstance(init_args, Mapping):
            raise ConfigError(f"{KEY}.init_args must be a mapping, got {init_args!r}")
        target = registry.import_path(spec["class_path"])
        return functools.partial(target, **init_args) if init_args else target
    if not callable(spec):
        raise ConfigError(f"{KEY} must be an import path, a class_path/init_args mapping or a callable, "
                          f"got {type(spec).__name__}")
    return spec


def in_thread(method: Callable[..., Any]) -> Callable[..., Any]:
    """An ``async`` callable with ``method``'s signature that runs ``method`` in a fresh daemon thread of this
    process (so an environment's state changes where its instance lives) and returns what it returns; what it
    raises (``SystemExit`` included) is raised to the awaiting caller. ``time_left()`` works inside (the caller's
    context is copied into the thread)."""

    @functools.wraps(method)
    async def call(**arguments: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        context = contextvars.copy_context()

        def settle(result: Any, exc: BaseException | None) -> None:
            if not future.done():  # cancelled when the call timed out
                future.set_exception(exc) if exc is not None else future.set_result(result)

        def work() -> None:
            try:
                result, exc = context.run(method, **arguments), None
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
                result, exc = None, e
            try:
                loop.call_soon_threadsafe(settle, result, exc)
            except RuntimeError:  # the loop is gone: nobody waits any more
                pass

        threading.Thread(target=work, name=f"rlflow-env-{method.__name__}", daemon=True).start()
        return await future

    return call


class SharedLoopToolRunner(ToolRunner):
    """A :class:`~rlflow.tools.base.ToolRunner` over one trajectory's tools that runs them on another runner's event
    loop (one loop for all trajectories), with that runner's timeout and isolation."""

    def __init__(self, tools: dict[str, Tool], shared: ToolRunner) -> None:
        super().__init__(tools, shared.timeout, shared.isolation)
        self.shared = shared

    def loop(self) -> asyncio.AbstractEventLoop:
        return self.shared.loop()


class EnvironmentFactory:
    """The configured ``environment_factory``: its tool schemas, and a pool of instances (see the module docstring).

    Building it makes one instance (TRL's probe, which seeds the pool) and checks the contract on it.

    Args:
        spec: An import path, a ``class_path``/``init_args`` mapping or a callable returning an instance.
        tools: The ``data.multiturn.tools`` by name; a method named like one of them is refused.
    """

    def __init__(self, spec: Any, tools: Mapping[str, Tool] | None = None) -> None:
        self.factory = load_factory(spec)
        probe = self.new()
        self.cls = type(probe)
        self.name = self.cls.__name__
        from rlflow.environments.base import Environment

        if isinstance(probe, Environment):
            raise ConfigError(f"{KEY}: {self.name} is an rlflow Environment (reset/step); name it in "
                              "data.multiturn.environment instead")
        if not callable(getattr(probe, "reset", None)):
            raise ConfigError(f"{KEY}: {self.name} has no callable reset(); TRL's environments define reset(**row)")
        names = tool_names(self.cls)
        if not names:
            raise ConfigError(f"{KEY}: {self.name} has no public method, so the model would have no tool to call "
                              "(every public method but reset and get_reward is a tool)")
        clash = sorted(set(names) & set(tools or {}))
        if clash:
            raise ConfigError(f"{KEY}: {self.name}.{clash[0]} has the name of a tool of data.multiturn.tools; tool "
                              "names must be unique")
        self.schemas = {name: self.schema(getattr(probe, name)) for name in names}
        self.has_reward = callable(getattr(self.cls, "get_reward", None))
        self.reset_accepts = accepted_keywords(probe.reset)
        self.pool: list[Any] = [probe]
        self.reward_failed = False  # a get_reward() failure was logged

    def __getstate__(self) -> dict[str, Any]:  # instances need not pickle; a copy makes new ones
        return {**self.__dict__, "pool": []}

    def schema(self, method: Callable[..., Any]) -> dict[str, Any]:
        """The JSON schema of tool method ``method`` (transformers' ``get_json_schema``); ConfigError naming it."""
        from transformers.utils import get_json_schema

        try:
            return get_json_schema(method)
        except Exception as exc:  # transformers raises DocstringParsingException / TypeHintParsingException
            raise ConfigError(f"{KEY}: cannot build the JSON schema of tool method {self.name}.{method.__name__}: "
                              f"{exc} (a tool method needs type hints on every argument and a Google-style "
                              "docstring with an Args: section; name helpers with a leading _)") from exc

    def new(self) -> Any:
        """A new instance from the factory; a factory that raises stops the run in one line."""
        try:
            return self.factory()
        except (Exception, SystemExit) as exc:
            target = getattr(self.factory, "func", self.factory)  # a class_path with init_args: a partial
            name = getattr(target, "__name__", None) or repr(target)
            raise registry.PluginError(f"{KEY}: {name}() raised {type(exc).__name__}: {exc}") from exc

    # ------------------------------------------------------------------------------------------- instances
    def take(self, n: int) -> list[Any]:
        """``n`` instances for one rollout (one per trajectory): the pool's first ``n``, more made when it is short."""
        while len(self.pool) < n:
            self.pool.append(self.new())
        return self.pool[:n]

    def retire(self, instance: Any) -> None:
        """Take ``instance`` out of the pool (a call of it timed out and may still be running)."""
        self.pool = [x for x in self.pool if x is not instance]

    def tools_for(self, instance: Any) -> dict[str, Tool]:
        """The tools of ``instance``: its methods, by name, with the class's schemas; a plain method runs in a
        trainer thread (:func:`in_thread`), an ``async def`` one as it is."""
        tools = {}
        for name, schema in self.schemas.items():
            method = getattr(instance, name)
            tools[name] = Tool(name, method if inspect.iscoroutinefunction(method) else in_thread(method), schema)
        return tools

    def reset(self, instance: Any, row: dict[str, Any], where: str) -> str | None:
        """``instance.reset(**row)`` (a deep copy, the columns it takes): None or the text to append to the prompt;
        PluginError naming the class and ``where`` (the row) when it raises or returns anything else."""
        try:
            observation = instance.reset(**select_keywords(copy.deepcopy(row), self.reset_accepts))
        except (Exception, SystemExit) as exc:
            raise registry.PluginError(f"{KEY}: {self.name}.reset raised {type(exc).__name__}: {exc} on the row "
                                       f"{where}") from exc
        if isinstance(observation, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                                 for p in observation):
            observation = "".join(str(p.get("text", "")) for p in observation)  # TRL's text content blocks
        if observation is not None and not isinstance(observation, str):
            raise registry.PluginError(f"{KEY}: {self.name}.reset returned a {type(observation).__name__} on the row "
                                       f"{where}; it must return None or a string (appended to the prompt)")
        return observation

    def rewards(self, instances: Sequence[Any], shared: ToolRunner) -> list[tuple[float | None, bool]]:
        """Each instance's ``get_reward()`` (all at once, each within the tool timeout): ``(reward, failed)``; a
        failure (it raised or timed out) gives ``(None, True)``, logged once. Without ``get_reward``: all None."""
        if not self.has_reward or not instances:
            return [(None, False)] * len(instances)
        calls = [m if inspect.iscoroutinefunction(m) else in_thread(m) for m in (x.get_reward for x in instances)]

        async def one(call: Callable[[], Any]) -> tuple[Any, BaseException | None]:
            async def run() -> tuple[Any, BaseException | None]:
                try:  # caught inside the task: a SystemExit leaving it would stop the loop
                    return await call(), None
                except asyncio.CancelledError:
                    raise
                except BaseException as exc:  # noqa: BLE001 - a failing get_reward costs its sample's reward
                    return None, exc

            try:
                return await asyncio.wait_for(run(), shared.timeout)
            except asyncio.TimeoutError:
                return None, TimeoutError(f"get_reward() did not return within {shared.timeout} s")

        async def every() -> list[tuple[Any, BaseException | None]]:
            return list(await asyncio.gather(*(one(c) for c in calls)))

        out = []
        for value, exc in asyncio.run_coroutine_threadsafe(every(), shared.loop()).result():
            if exc is not None:
                (log.debug if self.reward_failed else log.warning)(
                    "environment %s.get_reward() failed; its sample gets no env_reward (counted in env/failures, "
                    "logged once): %s: %s", self.name, type(exc).__name__, exc)
                self.reward_failed = True
                out.append((None, True))
            elif value is None:
                out.append((None, False))
            elif isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise registry.PluginError(f"{KEY}: {self.name}.get_reward() returned {value!r} "
                                           f"({type(value).__name__}); it must return a number or None")
            else:
                out.append((float(value), False))
        return out


def observed_prompt_text(record: Any, observation: str, render: Callable[[list[dict[str, Any]]], str]) -> str:
    """The prompt text of ``record`` with ``reset``'s ``observation`` appended to its last message (TRL's rule), or
    to a plain-string prompt. The record's rendered text is kept (its system prompt, template and tools) and the
    observation inserted right after the last message's content; where that content cannot be found in it (a
    template that rewrites it), the changed messages are rendered again with ``render``."""
    if record.images:
        raise registry.PluginError(f"{KEY}: reset returned an observation for the row {record.source}, which has "
                                   "images; appending to a prompt with images is not supported (return None)")
    if isinstance(record.prompt, str):
        return (record.prompt_text or record.prompt) + observation
    last = record.prompt[-1]
    content = last.get("content")
    at = record.prompt_text.rfind(content) if isinstance(content, str) and content else -1
    if at >= 0:
        end = at + len(content)
        return record.prompt_text[:end] + observation + record.prompt_text[end:]
    if isinstance(content, list):
        content = [*content, {"type": "text", "text": observation}]
    else:
        content = (content or "") + observation
    return render([*record.prompt[:-1], {**last, "content": content}])
