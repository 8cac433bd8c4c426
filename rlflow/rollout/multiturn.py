"""Multi-turn rollouts: the model calls tools or talks to an environment, token-in/token-out, on any backend.

:class:`MultiTurn` drives a :class:`~rlflow.rollout.base.RolloutBackend` turn by turn. A trajectory is

    prompt ids | sampled turn 1 | inserted tokens 1 | sampled turn 2 | ... | sampled turn T

and everything after the prompt is one :class:`~rlflow.rollout.base.Completion` whose ``mask`` is True exactly on
the sampled tokens (their ``logprobs`` are the sampler's; the inserted ones get 0.0 and are context only: no loss,
no log-prob, no KL). Each turn:

1. the backend generates from the token ids of the trajectory so far (the first turn: ``n`` = group size from the
   prompt, so the engine shares the prompt's prefill; later turns: one request per trajectory), with the rest of
   the ``data.sampling.max_tokens`` budget as the turn's limit;
2. the turn's text is decoded (for the parser and the messages only: the sampled ids themselves are kept), the tool
   parser finds the calls, every active trajectory's calls run concurrently in the :class:`ToolRunner` (timeout per
   call; failures become tool messages; each result's text cut to ``data.multiturn.max_tool_output`` characters),
   the environment (if any) answers the turn (the text of its observation's messages cut the same way);
3. the new messages (tool results, the environment's observation) are turned into tokens by rendering the chat
   template and keeping only what it adds after the model's turn: :meth:`MultiTurn.insert_ids` renders a
   placeholder conversation ``[user, assistant(PLACEHOLDER), *new messages]`` with the generation prompt and takes
   the text after ``PLACEHOLDER``, minus the stop token the model already sampled (``<|im_end|>``), so the
   template's end-of-turn remainder (``\\n``), the new messages and the next ``<|im_start|>assistant\\n`` are
   inserted. The sampled text is never re-rendered or re-tokenized, so a template that is not append-only
   (Qwen3 drops earlier turns' ``<think>`` blocks) cannot make the trained ids drift from the sampled ones.

A trajectory ends when a turn has no tool call and no environment observation, the environment says ``done``, at
``data.multiturn.max_turns`` model turns, or when the budget is spent (``finish_reason`` ``length``).

TRL's ``environment_factory`` (:mod:`rlflow.environments.trl_factory`): each trajectory takes its own instance from
the factory's pool; ``reset(**row)``'s text is appended to its prompt (which is then that trajectory's own, so the
prefill is not shared), its calls go to the instance's methods (with the configured tools) through a
:class:`~rlflow.environments.trl_factory.SharedLoopToolRunner` on the shared runner's loop, and once the rollout has
ended ``get_reward()`` (if defined) is the trajectory's ``env_reward``. The instance rides on the completion
(``info["environment"]``, an rlflow environment's too), from where judgers get ``environments``.

Scheduling. Trajectories run at their own pace on every built-in backend (:meth:`MultiTurn.run_async`, for a
backend with ``serve``): the backend takes requests from a :class:`TurnSource` (:mod:`rlflow.rollout.requests`); a
generated turn's tool calls go to the :class:`ToolRunner` with a completion callback that puts the results in a
thread-safe inbox, and the backend polls the inbox between its own units of work, so a trajectory whose tools have
answered is continued at once while the others generate or wait on their own tools; finished trajectories leave.
Tool results are inserted, environments stepped and requests built on the backend's thread; only the tools (and
``lmdeploy``'s HTTP requests) run elsewhere. Per backend:

* ``engine``: polled between two decode steps; a continuation is admitted into the running batch and continued
  from its kept KV cache (only the last sampled token and the inserted ones are prefilled,
  :mod:`rlflow.rollout.continuation`);
* ``hf``: whenever ``model.generate`` is idle, every ready trajectory is batched into one ``generate`` call (its
  whole token ids re-prefilled; a trajectory that becomes ready meanwhile waits for that call to end);
* ``lmdeploy``: each ready trajectory's next turn is one ``/generate`` request sent at once from a thread pool (the
  server batches what is in flight); the colocated engine is woken once before the rollout and put to sleep once
  after it, not around each request.

Trajectory ``j`` samples from its own counter-based random stream ``(call key, j)``, its counter running over all
its sampled tokens (:mod:`rlflow.rollout.draws`; on ``hf`` through a logits processor,
:class:`rlflow.rollout.hf.RowDrawsSampler`), so with a seed its tokens do not depend on when its turns were
generated or beside whom, whatever the tools' timing (log-probs are equal up to the float rounding of the batch
composition); ``hf`` and the ``engine`` with the same seed sample the same trajectories. ``lmdeploy`` samples with
the server's own generator, so its rollouts are not reproducible.

:meth:`MultiTurn.run_sync` (a backend without ``serve``, e.g. a plugin's) runs turn by turn over the batch: a turn
is one ``generate`` call over every active trajectory, and it starts when every tool of the turn before has
answered, so there a slow tool delays the other trajectories' next turns; a trajectory's tool calls still start as
soon as the turn's batch has returned.

Simplifications: environments are stepped on the decoding thread (a slow ``step`` holds the decode loop; tools are
the concurrent part); ``lmdeploy`` looks at the inbox every ``poll_interval`` seconds while requests are in flight
(a poll, not a wake-up); the engine admits continuations in prefill batches of up to ``prefill_batch_size`` and within
``max_batch_size`` rows, first come first served.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import queue
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rlflow import registry
from rlflow.config_error import ConfigError
from rlflow.environments.base import Environment, EnvStep
from rlflow.environments.trl_factory import (
    BOTH_ENVIRONMENTS,
    EnvironmentFactory,
    SharedLoopToolRunner,
    observed_prompt_text,
)
from rlflow.rollout.base import Completion, Progress, RolloutBackend, SamplingParams
from rlflow.rollout.draws import stream_key
from rlflow.rollout.requests import DecodeRequest
from rlflow.tools.base import MAX_TOOL_OUTPUT, Tool, ToolCall, ToolResult, ToolRunner, converted
from rlflow.tools.parsers import GROUP as PARSER_GROUP
from rlflow.tools.parsers import ToolParser

ENV_GROUP = "rlflow.environments"
PLACEHOLDER = "\u2063RLFLOW_TURN\u2063"
log = logging.getLogger(__name__)


@dataclass
class _Trajectory:
    prompt_ids: list[int]
    messages: list[dict[str, Any]]  # the conversation after the prompt
    env: Environment | None = None
    instance: Any = None  # the trajectory's environment_factory instance (TRL's contract)
    runner: ToolRunner | None = None  # the tools of ``instance`` with the configured tools; None: MultiTurn.runner
    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: int = 0
    finish_reason: str = "stop"
    done: bool = False
    env_reward: float | None = None
    tool_calls: Counter = field(default_factory=Counter)
    tool_failures: Counter = field(default_factory=Counter)
    env_failed: bool = False

    def completion(self) -> Completion:
        info = {"turns": self.turns, "tool_calls": dict(self.tool_calls), "tool_failures": dict(self.tool_failures),
                "env_failed": self.env_failed}
        environment = self.instance if self.instance is not None else self.env
        if environment is not None:  # the judgers' ``environments`` (rlflow.judgers.context.environments_of)
            info["environment"] = environment
        return Completion(self.ids, self.logprobs, self.finish_reason, mask=self.mask, prompt_ids=self.prompt_ids,
                          messages=self.messages, env_reward=self.env_reward, info=info)


def assistant_message(content: str, calls: list[ToolCall]) -> dict[str, Any]:
    """The assistant message of a turn in the transformers/TRL layout (``tool_calls`` when there are any)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments or {}}}
                                 for c in calls]
    return message


class MultiTurn:
    """Runs multi-turn rollouts with tools and/or an environment over any rollout backend.

    Args:
        tokenizer: The policy's tokenizer (its chat template renders the inserted messages).
        tools: The tools by name (:func:`rlflow.tools.base.load_tools`); may be empty with an environment.
        parser: The tool-call parser: a short name of the ``rlflow.tool_parsers`` group, an import path or an
            object.
        environment: The environment: a short name of ``rlflow.environments``, an import path, a
            ``class_path``/``init_args`` mapping, or None. One instance is built per trajectory.
        environment_factory: TRL's ``environment_factory`` (:mod:`rlflow.environments.trl_factory`): an import
            path, a ``class_path``/``init_args`` mapping, a callable or a built :class:`EnvironmentFactory`; its
            public methods are tools, one instance per trajectory. Not together with ``environment``.
        max_turns: Most model turns per trajectory.
        tool_timeout: Seconds one tool call may take.
        tool_isolation: Where a user's plain tools run: ``process`` (worker processes the timeout kills) or
            ``thread`` (:class:`~rlflow.tools.base.ToolRunner`).
        chat_template_kwargs: Passed to every ``apply_chat_template`` (``tools`` is added from ``tools``).
        max_tool_output: Characters kept of a tool result's text, and of each text of an environment's
            observation; the rest is cut, saying how much.
    """

    def __init__(self, tokenizer: Any, tools: dict[str, Tool], parser: Any = "hermes", environment: Any = None,
                 max_turns: int = 4, tool_timeout: float | None = 30.0, tool_isolation: str = "process",
                 chat_template_kwargs: dict[str, Any] | None = None, environment_factory: Any = None,
                 max_tool_output: int = MAX_TOOL_OUTPUT) -> None:
        if max_turns < 1:
            raise ValueError(f"data.multiturn.max_turns must be >= 1, got {max_turns}")
        if environment is not None and environment_factory is not None:
            raise ConfigError(BOTH_ENVIRONMENTS)
        self.tokenizer = tokenizer
        self.tools = tools
        self.runner = ToolRunner(tools, tool_timeout, tool_isolation, max_tool_output)
        self.parser: ToolParser = registry.build(PARSER_GROUP, parser)
        self.environment = environment
        if environment is not None:
            self.make_env()  # a wrong name or argument fails now, not mid-rollout
        self.factory: EnvironmentFactory | None = None
        if environment_factory is not None:
            self.factory = environment_factory if isinstance(environment_factory, EnvironmentFactory) else \
                EnvironmentFactory(environment_factory, tools)
        self.max_turns = max_turns
        self.template_kwargs = dict(chat_template_kwargs or {})
        schemas = tool_schemas(tools, self.factory)
        if schemas:
            self.template_kwargs["tools"] = schemas

    def make_env(self) -> Environment:
        spec = self.environment
        if isinstance(spec, Environment):
            return copy.deepcopy(spec)
        env = registry.build(ENV_GROUP, spec)
        if isinstance(env, type):
            env = env()
        return env

    # ---------------------------------------------------------------------------------------- tokens
    def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **self.template_kwargs)

    def insert_ids(self, new_messages: list[dict[str, Any]], last_sampled: int | None) -> list[int]:
        """The token ids the chat template adds after a model turn that ended with ``last_sampled``, for
        ``new_messages`` and the next generation prompt (see the module docstring)."""
        dummy = [{"role": "user", "content": "?"}, {"role": "assistant", "content": PLACEHOLDER}]
        text = self.render(dummy + new_messages, generation_prompt=True)
        at = text.rfind(PLACEHOLDER)
        if at < 0:
            raise ValueError("the chat template does not render an assistant message's content verbatim, so the "
                             "tokens of tool/environment messages cannot be isolated from it")
        suffix = text[at + len(PLACEHOLDER):]
        if last_sampled is not None:
            stop_text = self.tokenizer.decode([last_sampled])
            if stop_text and suffix.startswith(stop_text):
                suffix = suffix[len(stop_text):]
        return self.tokenizer.encode(suffix, add_special_tokens=False)

    def start(self, record: Any, instance: Any = None) -> _Trajectory:
        """A trajectory for ``record``: its own prompt, or the environment's first messages rendered, or (TRL's
        ``environment_factory``, with ``instance``) the prompt with ``instance.reset(**row)``'s text appended."""
        env = self.make_env() if self.environment is not None else None
        prompt_ids = list(record.prompt_ids)
        if env is not None:
            first = env.reset({"prompt": record.prompt, **record.columns})
            if first is not None:
                prompt_ids = self.tokenizer.encode(self.render(first, generation_prompt=True),
                                                   add_special_tokens=False)
        if instance is None:
            return _Trajectory(prompt_ids, [], env)
        observation = self.factory.reset(instance, {"prompt": record.prompt, **record.columns}, record.source)
        if observation is not None:
            text = observed_prompt_text(record, observation, lambda messages: self.render(messages, True))
            prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        runner = SharedLoopToolRunner({**self.tools, **self.factory.tools_for(instance)}, self.runner)
        runner.max_output = self.runner.max_output  # the shared runner's cut, as its timeout and isolation
        return _Trajectory(prompt_ids, [], env, instance=instance, runner=runner)

    # ---------------------------------------------------------------------------------------- the loop
    def generate(self, backend: RolloutBackend, records: list[Any], params: SamplingParams, n: int = 1,
                 progress: Progress | None = None) -> list[list[Completion]]:
        """``n`` multi-turn trajectories per record, in record order."""
        instances = self.factory.take(len(records) * n) if self.factory is not None else [None] * (len(records) * n)
        trajectories = [self.start(r, instances[i * n + j]) for i, r in enumerate(records) for j in range(n)]
        if self.environment is None and all(t.prompt_ids == records[i // n].prompt_ids
                                            for i, t in enumerate(trajectories)):
            # n samples of each prompt: the backend shares the prompt's prefill
            prompts, owners, k = [r.prompt_ids for r in records], [list(range(i * n, (i + 1) * n))
                                                                    for i in range(len(records))], n
        else:
            prompts, owners, k = [t.prompt_ids for t in trajectories], [[i] for i in range(len(trajectories))], 1
        keep_caches = getattr(backend, "keep_caches", None)  # the engine: continue from each row's own KV cache
        with keep_caches() if keep_caches is not None else contextlib.nullcontext():
            if hasattr(backend, "serve"):  # each trajectory's next turn as soon as its tools answered
                self.run_async(backend, trajectories, prompts, owners, k, params)
            else:
                self.run_sync(backend, trajectories, prompts, owners, k, params)
        if self.factory is not None:
            self.finish_instances(trajectories)
        done = [t.completion() for t in trajectories]
        if progress is not None:
            progress(len(done), sum(sum(c.mask) for c in done))
        return [done[i * n: (i + 1) * n] for i in range(len(records))]

    def run_sync(self, backend: RolloutBackend, trajectories: list[_Trajectory], prompts: list[list[int]],
                 owners: list[list[int]], k: int, params: SamplingParams) -> None:
        """Turn by turn over the batch (a backend without ``serve``): each turn is one backend call over every
        active trajectory, after every tool of the turn before has answered."""
        budget = params.max_tokens
        active = list(range(len(trajectories)))
        while True:
            self.run_turn(backend, trajectories, prompts, owners, dataclasses.replace(params, max_tokens=min(
                budget, max(budget - len(trajectories[i].ids) for i in active))), k, budget)
            active = [i for i in active if not trajectories[i].done]
            if not active:
                return
            prompts = [trajectories[i].prompt_ids + trajectories[i].ids for i in active]
            owners, k = [[i] for i in active], 1

    def run_async(self, backend: Any, trajectories: list[_Trajectory], prompts: list[list[int]],
                  owners: list[list[int]], k: int, params: SamplingParams) -> None:
        """Every trajectory at its own pace on a backend with ``serve`` (``engine``, ``hf``, ``lmdeploy``): a
        turn's tool calls start when its group is generated, and the trajectory's next turn goes back to the backend
        as soon as they have answered, while the others generate or wait on their own tools (:class:`TurnSource`).
        Trajectory ``j`` samples from the random stream ``(call key, j)``, its token counter running over all its
        turns, so what it samples does not depend on the tools' timing (:mod:`rlflow.rollout.draws`)."""
        key = 0 if params.greedy else backend.next_call_key()
        first = [DecodeRequest(p, [stream_key(key, j) for j in own], 0, params.max_tokens, own)
                 for p, own in zip(prompts, owners)]
        source = TurnSource(self, trajectories, key, params.max_tokens, first)
        for request, group in backend.serve(source, params):
            for j, out in zip(request.tag, group):
                source.turn_done(j, out)

    def run_turn(self, backend: RolloutBackend, trajectories: list[_Trajectory], prompts: list[list[int]],
                 owners: list[list[int]], params: SamplingParams, n: int, budget: int) -> None:
        """One model turn of the trajectories ``owners`` names (``n`` per prompt): each finished group's tool calls
        start at once (on a backend that streams, while the others still generate), then the tool results and the
        environment's answers are inserted, trajectory by trajectory in order."""
        pending: dict[int, tuple[Completion, str, list[ToolCall], Any]] = {}
        for p, group in backend.stream(prompts, params, n=n):
            for i, out in zip(owners[p], group):
                text, calls = self.take_turn(trajectories[i], out, budget)
                pending[i] = (out, text, calls, self.runner_of(trajectories[i]).submit(calls) if calls else None)
        for i in sorted(pending):
            out, text, calls, future = pending[i]
            self.finish_turn(trajectories[i], out, text, calls, future.result() if future is not None else [], budget)

    def take_turn(self, t: _Trajectory, out: Completion, budget: int) -> tuple[str, list[ToolCall]]:
        """Append a sampled turn to ``t`` (cut to the budget left); return its text and the calls to run."""
        room = budget - len(t.ids)
        tokens, lps = out.token_ids[:room], out.logprobs[:room]
        cut = len(tokens) < len(out.token_ids)
        t.ids += tokens
        t.logprobs += [float(x) for x in lps]
        t.mask += [True] * len(tokens)
        t.turns += 1
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        content, calls = self.parser.parse(text) if self.tools or self.factory is not None else (text, [])
        t.messages.append(assistant_message(content, calls))
        if cut or out.finish_reason == "length" or len(t.ids) >= budget:
            t.finish_reason, t.done = "length", True
        return text, [] if t.done or t.turns >= self.max_turns else calls

    def finish_turn(self, t: _Trajectory, out: Completion, text: str, calls: list[ToolCall],
                    results: list[ToolResult], budget: int) -> None:
        """Count the calls, ask the environment, and insert the new messages' tokens (or end the trajectory)."""
        if t.done:
            return
        new: list[dict[str, Any]] = []
        for call, result in zip(calls, results):
            t.tool_calls[call.name or "?"] += 1
            if not result.ok:
                t.tool_failures[result.failure or "failed"] += 1
            new.append({"role": "tool", "name": result.name, "content": result.content})
        step = self.env_step(t, text) if t.env is not None else EnvStep()
        if step.reward is not None:
            t.env_reward = (t.env_reward or 0.0) + float(step.reward)
        new += [self.cut_message(m) for m in step.observation]
        if step.done or not new or t.turns >= self.max_turns:
            t.done = True
            return
        inserted = self.insert_ids(new, out.token_ids[-1] if out.finish_reason == "stop" else None)
        t.messages += new
        if len(t.ids) + len(inserted) >= budget:  # no room left for another model turn
            t.finish_reason, t.done = "length", True
            return
        t.ids += inserted
        t.logprobs += [0.0] * len(inserted)
        t.mask += [False] * len(inserted)

    def cut_message(self, message: Any) -> Any:
        """An environment's observation message with its text cut to ``max_tool_output`` characters, as a tool
        result's (the rest cut, saying how much): a string ``content``, or each ``text`` of its content parts."""
        limit = self.runner.max_output
        if not isinstance(message, dict):
            return message
        content = message.get("content")
        if isinstance(content, str):
            return {**message, "content": converted(content, limit).text}
        if isinstance(content, list):
            parts = [{**p, "text": converted(p["text"], limit).text} if isinstance(p, dict)
                     and isinstance(p.get("text"), str) else p for p in content]
            return {**message, "content": parts}
        return message

    def runner_of(self, t: _Trajectory) -> ToolRunner:
        """The tool runner of ``t``'s calls: its instance's methods with the configured tools, or the shared one."""
        return t.runner if t.runner is not None else self.runner

    def finish_instances(self, trajectories: list[_Trajectory]) -> None:
        """After an ``environment_factory`` rollout: each instance's ``get_reward()`` is its trajectory's
        ``env_reward`` (a failure counts in ``env/failures``); an instance whose tool call timed out, or whose
        ``get_reward()`` failed, leaves the pool (what timed out may still be running on it)."""
        for t, (reward, failed) in zip(trajectories, self.factory.rewards([t.instance for t in trajectories],
                                                                          self.runner)):
            t.env_reward, t.env_failed = reward, t.env_failed or failed
            if failed or t.tool_failures.get("timeout"):
                self.factory.retire(t.instance)

    @staticmethod
    def env_step(t: _Trajectory, text: str) -> EnvStep:
        try:
            step = t.env.step(text)
        except Exception as exc:  # noqa: BLE001 - a failing environment ends its trajectory, not the run
            log.warning("environment %s raised on a turn; its trajectory ends (counted in env/failures): %s: %s",
                        type(t.env).__name__, type(exc).__name__, exc)
            t.env_failed = True
            return EnvStep(done=True)
        if not isinstance(step, EnvStep):
            raise TypeError(f"environment {type(t.env).__name__}.step() returned {type(step).__name__}; "
                            "it must return an EnvStep")
        return step


def tool_schemas(tools: dict[str, Tool], factory: EnvironmentFactory | None) -> list[dict[str, Any]]:
    """The JSON schemas the chat template renders: the configured tools', then the ``environment_factory``'s."""
    return [t.schema for t in tools.values()] + (list(factory.schemas.values()) if factory is not None else [])


class TurnSource:
    """The request source of an asynchronous multi-turn call (:meth:`MultiTurn.run_async`): trajectories' next
    turns, queued as their tools answer.

    A generated turn whose calls go to the :class:`~rlflow.tools.base.ToolRunner` gets a completion callback that
    puts the results in a thread-safe inbox; the decode loop polls the inbox between its steps (and waits on it when
    it has nothing to decode), so tool results are inserted, environments stepped and continuation requests built
    on the decoding thread, one trajectory at a time, while only the tools run elsewhere.
    """

    def __init__(self, multiturn: MultiTurn, trajectories: list[_Trajectory], key: int, budget: int,
                 first: list[DecodeRequest]) -> None:
        self.mt, self.trajectories, self.key, self.budget = multiturn, trajectories, key, budget
        self.ready: list[DecodeRequest] = list(first)
        self.inbox: queue.Queue = queue.Queue()  # (trajectory, future of its tool results), from the tool threads
        self.turns: dict[int, tuple[Completion, str, list[ToolCall]]] = {}  # trajectories waiting on their tools
        self.open = sum(not t.done for t in trajectories)  # trajectories not finished

    def turn_done(self, j: int, out: Completion) -> None:
        """Trajectory ``j`` sampled ``out``: start its tool calls (results come back through the inbox) or, with
        none, finish its turn now."""
        text, calls = self.mt.take_turn(self.trajectories[j], out, self.budget)
        if calls:
            self.turns[j] = (out, text, calls)
            self.mt.runner_of(self.trajectories[j]).submit(calls).add_done_callback(
                lambda future, j=j: self.inbox.put((j, future)))
        else:
            self.finish(j, out, text, [], [])

    def finish(self, j: int, out: Completion, text: str, calls: list[ToolCall], results: list[ToolResult]) -> None:
        t = self.trajectories[j]
        self.mt.finish_turn(t, out, text, calls, results, self.budget)
        if t.done:
            self.open -= 1
        else:  # its next turn: the whole history, continued from its kept cache on the engine
            self.ready.append(DecodeRequest(t.prompt_ids + t.ids, [stream_key(self.key, j)], sum(t.mask),
                                            self.budget - len(t.ids), [j]))

    def poll(self, wait: bool) -> list[DecodeRequest] | None:
        while True:
            try:
                j, future = self.inbox.get(block=wait and not self.ready and bool(self.turns))
            except queue.Empty:
                break
            out, text, calls = self.turns.pop(j)
            self.finish(j, out, text, calls, future.result())
        if not self.ready and not self.open:
            return None
        if wait and not self.ready:
            raise RuntimeError("multi-turn: the decode loop is idle, no tool is running and no turn is queued, but "
                               f"{self.open} trajectories are not finished")
        ready, self.ready = self.ready, []
        return ready


def multiturn_metrics(completions: list[Completion]) -> dict[str, float]:
    """Tool and turn metrics of a batch, TRL's names where TRL has them: ``tools/call_frequency`` (tool calls per
    trajectory), ``tools/failure_frequency`` (failed share of the calls), ``tools/failures/<kind>``,
    ``tools/calls/<tool>``, ``turns/mean``/``max``, ``env/failures``."""
    infos = [c.info for c in completions if c.info is not None and "turns" in c.info]
    if not infos:
        return {}
    calls: Counter = Counter()
    failures: Counter = Counter()
    for info in infos:
        calls.update(info["tool_calls"])
        failures.update(info["tool_failures"])
    total, failed = sum(calls.values()), sum(failures.values())
    metrics = {
        "tools/call_frequency": total / len(infos),
        "tools/failure_frequency": failed / total if total else 0.0,
        "turns/mean": sum(i["turns"] for i in infos) / len(infos),
        "turns/max": float(max(i["turns"] for i in infos)),
        "env/failures": float(sum(bool(i.get("env_failed")) for i in infos)),
    }
    metrics.update({f"tools/calls/{name}": float(v) for name, v in sorted(calls.items())})
    metrics.update({f"tools/failures/{kind}": float(v) for kind, v in sorted(failures.items())})
    return metrics


class RecordsRollout(RolloutBackend):
    """A backend view of one multi-turn call: ``generate`` is answered for the bound ``records`` (the prompt ids
    it gets must be theirs), so the judging code that drives a backend (:mod:`rlflow.judgers.overlap`) drives
    multi-turn rollouts unchanged."""

    streams = False

    def __init__(self, multiturn: MultiTurn, backend: RolloutBackend, records: list[Any]) -> None:
        self.multiturn, self.backend, self.records = multiturn, backend, records

    def generate(self, prompts: list[list[int]], params: SamplingParams, n: int = 1,
                 progress: Progress | None = None) -> list[list[Completion]]:
        if [list(p) for p in prompts] != [list(r.prompt_ids) for r in self.records]:
            raise ValueError("RecordsRollout.generate got prompts other than its records'")
        return self.multiturn.generate(self.backend, self.records, params, n=n, progress=progress)
