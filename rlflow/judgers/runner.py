"""Scores a batch of completions: routes each sample to its judgers, runs them concurrently, combines rewards.

Routing follows XTuner's ``JudgerConfig``: ``{"openai/gsm8k": "gsm8k"}`` maps a ``data_source`` to one judger
or a list of them; the key ``"*"`` catches every source without its own entry. Several judgers on one sample
are summed with ``reward_weights`` (default 1.0), skipping ``None`` ("not applicable") as TRL's NaN-aware sum
does; a sample no judger scored gets 0.0 and is counted in ``judger/unscored``.

All judgers of a batch run at once, awaited on the runner's event loop. With ``isolation="process"`` (the default,
``data.judging.isolation``) a user-written synchronous judger (a TRL-style reward function, a plugin's judger, the
``function`` judger's function: :func:`runs_in_worker`; one that a new process can load, not a closure) runs in a
worker process (:class:`rlflow.isolation.Isolated`): at the timeout the worker is killed, with every process it
started, and the next batch gets a fresh one (counted in ``judger/killed_workers``); a worker that dies fails its
call with how it ended. The call's ``trainer_state`` travels to the worker, its ``log_extra``/``log_metric`` calls
are checked there and replayed here, and a judger's ``consume_failed()`` report comes back with its rewards.
rlflow's own judgers, ``async def`` ones and those taking ``environments`` (whose instances live in the trainer) run
in the trainer, as every judger does with ``isolation="thread"``: plain ones each in its own daemon thread (so a
hung one can be abandoned and cannot block the process from exiting), ``async def`` ones on an event loop of their
own, one per judger in its own daemon thread, kept across batches (so loop-bound clients survive, and an async
judger that blocks its loop, e.g. with ``time.sleep``, stalls only that loop; the next batch gets it a fresh one).
Every call has a timeout; a judger that raises (any exception, ``SystemExit`` and ``KeyboardInterrupt`` raised
inside it too) or times out gives ``None`` for its samples, is counted in ``judger/failures`` and logged with its
exception once, and training goes on; so does an infinite reward (NaN means "not applicable", as in TRL). Each
judger's share of the failures is in :attr:`JudgeResult.judgers`, from which :meth:`JudgeResult.problem` tells a
judger that cannot work (it failed on every sample, or on more than ``data.judging.max_failure_rate`` of them):
:func:`stop_if_unusable` stops the run on it with a :class:`JudgerError`.
A judger that breaks the contract (wrong number of rewards, a non-number) is a bug, not bad luck: that is an
error naming it.

Each call gets TRL's keywords besides the samples and columns: ``trainer_state``, ``log_extra`` and
``log_metric`` (:mod:`rlflow.judgers.context`); a judger without ``**kwargs`` gets only those its signature names.

Simplifications: one call per judger per batch (a judger batches or parallelises inside itself, as
``remote`` does); a timed-out thread (a judger running in the trainer) is abandoned, not killed (Python cannot
kill threads): the threads still running are counted in ``judger/abandoned_threads``. The wait for a whole
batch is bounded too (the timeout and a few seconds), so not even a broken event loop can hang the run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import inspect
import logging
import math
import numbers
import pickle
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlflow import registry
from rlflow.config_error import ConfigError
from rlflow.isolation import Isolated, Outcome, Recorded, _one_line, close_all, portable, warm_up
from rlflow.judgers.context import (
    JudgerLogs,
    RunState,
    accepted_keywords,
    before_training,
    metric_value,
    plain,
    select_keywords,
)
from rlflow.judgers.function import FunctionJudger
from rlflow.log import info

GROUP = "rlflow.judgers"
log = logging.getLogger(__name__)
#: Seconds a batch's judging may run past ``data.judging.timeout`` before its wait gives up on the whole batch.
GRACE = 5.0
#: Seconds a judger's worker process is given past the timeout to be killed before the wait gives up on it.
KILL_MARGIN = 2.0
#: Where ``data.judging.isolation`` (and ``data.multiturn.tool_isolation``) may run user code.
ISOLATIONS = ("process", "thread")
#: Keywords whose values live in the trainer (TRL's ``environments``, the environment instances): a judger naming
#: one, or a call given one, runs in the trainer, where changes to them are seen.
TRAINER_ONLY = frozenset({"environments"})
#: Threads of plain judgers abandoned after their timeout (alive until the call returns, if ever).
_abandoned_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def abandoned_threads() -> int:
    """Judger threads abandoned after their timeout that are still running (in this process)."""
    return sum(thread.is_alive() for thread in list(_abandoned_threads))


def distinct_name(name: str, taken: dict[str, Any]) -> str:
    """``name``, or where another judger has it (one plugin twice with different ``init_args``) ``name_2``,
    ``name_3``, ... (as ``rlflow config from-trl`` names a reward function listed twice), said in one line."""
    if name not in taken:
        return name
    number = 2
    while f"{name}_{number}" in taken:
        number += 1
    info(f"data.judging.judgers: a second judger named {name!r} is {name}_{number} in the metrics and "
         "data.judging.weights")
    return f"{name}_{number}"


def judger_name(spec: Any, judger: Any) -> str:
    """The metric name of a judger: its short name, its ``name`` attribute, or its function name (as TRL)."""
    if isinstance(spec, dict) and spec.get("name"):
        return str(spec["name"])
    if isinstance(spec, str) and not registry.looks_like_path(spec):
        return spec
    name = getattr(judger, "name", None)
    if isinstance(name, str) and name not in ("", "judger"):
        return name
    if isinstance(spec, dict) and not registry.looks_like_path(str(spec["class_path"])):
        return str(spec["class_path"])
    if isinstance(spec, dict):
        return str(spec["class_path"]).replace(":", ".").rsplit(".", 1)[-1]
    return getattr(judger, "__name__", type(judger).__name__)


def is_async(judger: Any) -> bool:
    """Whether calling ``judger`` returns a coroutine: an ``async def`` function or an object with one as
    ``__call__``."""
    # B004 does not apply: this reads the ``__call__`` method itself to see whether it is ``async def``; it is not a
    # test of whether ``judger`` is callable, which ``callable()`` would answer instead
    return inspect.iscoroutinefunction(judger) or inspect.iscoroutinefunction(
        getattr(judger, "__call__", None)  # noqa: B004
    )


class JudgerContractError(registry.PluginError, ValueError, TypeError):
    """A judger broke its contract (one number or None per completion): a bug in it, so the run stops, with one
    ``rlflow: error:`` line (a PluginError) naming it; still a ValueError/TypeError for callers catching those."""


class JudgerTimeout(TimeoutError):
    """A judger did not return within ``data.judging.timeout`` seconds; ``killed``: its worker process was killed
    (else its thread was abandoned)."""

    def __init__(self, message: str, killed: bool = False) -> None:
        super().__init__(message)
        self.killed = killed


class JudgerError(registry.PluginError):
    """A judger cannot work (it failed on every sample of a step, or on more than ``data.judging.max_failure_rate``
    of them): the run stops with one ``rlflow: error:`` line (a PluginError) naming the judger, its exception and
    the keywords it was given."""


def one_line(exc: BaseException) -> str:
    """``Type: message`` of an exception, on one line; never raises (a judger in the trainer may raise an exception
    whose ``__str__`` raises): :func:`rlflow.isolation._one_line`."""
    return _one_line(exc)


@dataclass
class JudgerStats:
    """One judger's share of a judged batch: the samples routed to it, how many it failed on, and (where one did)
    the first failure, with the keywords that call was given; ``killed``: its worker processes killed at the
    timeout."""

    samples: int = 0
    failed: int = 0
    error: str | None = None
    keywords: tuple[str, ...] = ()
    killed: int = 0

    def __add__(self, other: JudgerStats) -> JudgerStats:
        first = self if self.error is not None else other
        return JudgerStats(self.samples + other.samples, self.failed + other.failed, first.error, first.keywords,
                           self.killed + other.killed)


@dataclass
class JudgeResult:
    """Rewards of one batch: the combined reward per sample and each judger's own (None where not applied)."""

    rewards: list[float]
    per_judger: dict[str, list[float | None]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    #: Per sample, the judgers that failed on it (raised, timed out, gave an infinite reward or, for a judger that
    #: reports its own per-sample failures, ``consume_failed()``, named it): trajectories.jsonl's ``judgers_failed``.
    #: Empty: none did.
    failed: list[tuple[str, ...]] = field(default_factory=list)
    #: Each judger's samples and failures (:meth:`problem` reads them).
    judgers: dict[str, JudgerStats] = field(default_factory=dict)
    #: Columns the judgers logged with ``log_extra``, one value per sample (None where a column was not logged).
    extra: dict[str, list[Any]] = field(default_factory=dict)
    #: Values the judgers logged with ``log_metric``, per name.
    logged: dict[str, list[float]] = field(default_factory=dict)

    def failed_at(self, i: int) -> tuple[str, ...]:
        """The judgers that failed on sample ``i`` (none where this result records no failures)."""
        return self.failed[i] if self.failed else ()

    def problem(self, max_failure_rate: float | None = None) -> str | None:
        """Why these rewards must not be trained on, or None: a judger failed on every one of its samples (or,
        with ``max_failure_rate``, on more than that fraction of them), or no judger scored any sample and some
        failed (the rewards would all be missing)."""
        for name, stats in sorted(self.judgers.items()):
            if max_failure_rate is None:
                broken, limit = stats.samples > 0 and stats.failed == stats.samples, ""
            else:
                broken = stats.failed > max_failure_rate * stats.samples
                limit = f" (more than data.judging.max_failure_rate={max_failure_rate:g})"
            if broken:
                return (f"judger {name!r} failed on {stats.failed} of its {stats.samples} samples{limit}: "
                        f"{stats.error or 'it reported them failed'}; it was given the keywords "
                        f"{', '.join(stats.keywords) or '(none)'}")
        if self.rewards and self.metrics.get("judger/unscored") == len(self.rewards) and any(
                stats.failed for stats in self.judgers.values()):
            failing = ", ".join(f"{name!r} on {stats.failed} ({stats.error})"
                                for name, stats in sorted(self.judgers.items()) if stats.failed)
            return (f"no judger scored any of the {len(self.rewards)} samples, so every reward would be missing; "
                    f"failed: {failing}")
        return None


def stop_if_unusable(result: JudgeResult, max_failure_rate: float | None, step: int,
                     any_rank: Callable[[bool], bool]) -> None:
    """Raise :class:`JudgerError` where rollout step ``step``'s ``result`` must not be trained on
    (:meth:`JudgeResult.problem`) on any rank (``any_rank(flag)``: whether ``flag`` holds on any; a collective, so
    every rank stops at the same step)."""
    problem = result.problem(max_failure_rate)
    if any_rank(problem is not None):
        problem = problem or "a judger cannot work on another rank (see its error)"
        raise JudgerError(f"rollout step {step}: {problem}")


def merge_results(n: int, parts: Sequence[tuple[Sequence[int], JudgeResult]]) -> JudgeResult:
    """One :class:`JudgeResult` for ``n`` samples from results of parts of them, each with the positions of its
    samples (mixed-source batches, batches judged in chunks); the metrics are recomputed over the whole batch."""
    rewards: list[float] = [0.0] * n
    failed: list[tuple[str, ...]] = [()] * n
    per_judger: dict[str, list[float | None]] = {}
    extra: dict[str, list[Any]] = {}
    logged: dict[str, list[float]] = {}
    judgers: dict[str, JudgerStats] = {}
    for positions, part in parts:
        for pos, i in enumerate(positions):
            rewards[i], failed[i] = part.rewards[pos], part.failed_at(pos)
        for merged, values_of in ((per_judger, part.per_judger), (extra, part.extra)):
            for name, values in values_of.items():
                column = merged.setdefault(name, [None] * n)
                for i, value in zip(positions, values):
                    column[i] = value
        for name, values in part.logged.items():
            logged.setdefault(name, []).extend(values)
        for name, stats in part.judgers.items():
            judgers[name] = judgers[name] + stats if name in judgers else stats
    return JudgeResult(rewards, per_judger, judge_metrics(per_judger, judgers), failed, judgers, extra, logged)


def judge_metrics(per_judger: dict[str, list[float | None]],
                  judgers: dict[str, JudgerStats] | None = None) -> dict[str, float]:
    """The metrics of a judged batch from each judger's per-sample values (None: not scored by it).

    ``judger/unscored`` counts samples no judger scored, ``judger/failures`` the judgers' failures (``judgers``: a
    failure is not visible in the values), ``judger/killed_workers`` the judgers' worker processes killed at their
    timeout, ``judger/abandoned_threads`` the judger threads (in the trainer) still running after their timeout, and
    ``rewards/<name>/mean|std`` (TRL's names; sample std) cover the scored samples.
    One implementation for the runner, mixed-source batches and batches judged in chunks.
    """
    n = max((len(v) for v in per_judger.values()), default=0)
    unscored = sum(all(values[i] is None for values in per_judger.values()) for i in range(n))
    failures = sum(stats.failed for stats in (judgers or {}).values())
    killed = sum(stats.killed for stats in (judgers or {}).values())
    metrics = {"judger/unscored": float(unscored), "judger/failures": float(failures),
               "judger/killed_workers": float(killed), "judger/abandoned_threads": float(abandoned_threads())}
    for name, values in per_judger.items():
        scored = [v for v in values if v is not None]
        if scored:
            mean = sum(scored) / len(scored)
            std = math.sqrt(sum((v - mean) ** 2 for v in scored) / (len(scored) - 1)) if len(scored) > 1 else 0.0
            metrics[f"rewards/{name}/mean"] = mean
            metrics[f"rewards/{name}/std"] = std
    return metrics


@dataclass
class _Call:
    """One judger call in flight: set ``ended`` once an async call's coroutine ends; ``thread`` runs a plain one (or
    waits on its worker process); ``killed``: its worker was killed at the timeout; ``reported``: what the judger's
    ``consume_failed()`` said in its worker process."""

    ended: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None
    killed: bool = False
    reported: tuple[list[int], int] | None = None


def is_rlflows(code: Any) -> bool:
    """Whether ``code`` (a function, class or instance) is defined in rlflow itself."""
    try:
        module = getattr(code, "__module__", None)
    except Exception:  # noqa: BLE001 - a hostile __getattr__: not ours
        module = None
    module = module if isinstance(module, str) else type(code).__module__
    return module == "rlflow" or module.startswith("rlflow.")


def names_any(code: Any, keywords: frozenset[str]) -> bool:
    """Whether the signature of ``code`` names one of ``keywords`` (False where it cannot be read)."""
    try:
        return not keywords.isdisjoint(inspect.signature(code).parameters)
    except (TypeError, ValueError):
        return False


def runs_in_worker(judger: Any) -> bool:
    """Whether ``data.judging.isolation: process`` runs ``judger`` in a worker process: a user-written synchronous
    judger (for the ``function`` judger, its function decides). rlflow's own judgers, ``async def`` ones and those
    whose signature names a keyword of :data:`TRAINER_ONLY` run in the trainer."""
    code = judger.fn if isinstance(judger, FunctionJudger) else judger
    return not (is_async(code) or is_rlflows(code) or names_any(code, TRAINER_ONLY))


#: Keywords handed to a judger as they are: the run's state, the logging callbacks, the live environments.
SHARED_KEYWORDS = frozenset({"trainer_state", "log_extra", "log_metric", "environments"})


def writes_user_code(judger: Any) -> bool:
    """Whether calling ``judger`` runs code that is not rlflow's (a user's judger, or the ``function`` judger's
    function): code that may change the lists and dicts it is given."""
    return not is_rlflows(judger.fn if isinstance(judger, FunctionJudger) else judger)


def private_copies(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with deep copies of the samples and dataset columns, so that a judger running in the trainer that
    changes them (a prompt's messages, an ``extra_info`` dict) changes neither the dataset's records nor what the
    other judgers see; :data:`SHARED_KEYWORDS` pass as they are."""
    return {key: value if key in SHARED_KEYWORDS else copy.deepcopy(value) for key, value in kwargs.items()}


def reported_failures(judger: Any) -> tuple[list[int], int]:
    """The samples ``judger`` gave None because of an error in its last call, for judgers that fail per sample (see
    :mod:`rlflow.judgers.base`): their positions in the call and how many, from ``consume_failed()``; from a judger
    that only counts them (``consume_failures()``), no positions and the count."""
    consume_failed = getattr(judger, "consume_failed", None)
    if callable(consume_failed):
        positions = sorted(consume_failed())
        return positions, len(positions)
    consume = getattr(judger, "consume_failures", None)
    return [], int(consume()) if callable(consume) else 0


class InWorker:
    """A judger as its worker process calls it: the rewards (an iterator or a coroutine resolved, to travel back)
    and the failures it reports for the call (:func:`reported_failures`)."""

    def __init__(self, judger: Any) -> None:
        self.judger = judger

    def __call__(self, **kwargs: Any) -> tuple[Any, tuple[list[int], int]]:
        out = self.judger(**kwargs)
        if inspect.isawaitable(out):
            out = asyncio.run(_awaited(out))
        if hasattr(out, "__next__"):  # a generator: a list travels
            out = list(out)
        try:
            pickle.dumps(out)
        except Exception as exc:  # noqa: BLE001 - anything pickle refuses: the call's failure, with what it was
            shown = repr(out)
            raise TypeError(f"it returned {shown[:200] + '...' if len(shown) > 200 else shown}, which cannot be sent "
                            f"back from its worker process ({one_line(exc)})") from None
        return out, reported_failures(self.judger)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _checked_extra(n: int, column: str, values: Any) -> tuple[str, list[Any]]:
    """A worker's ``log_extra`` arguments checked as :class:`JudgerLogs` checks them (raising inside the judger)."""
    values = list(values)
    if len(values) != n:
        raise ValueError(f"log_extra({column!r}, values) got {len(values)} values for the call's {n} completions "
                         "(one per completion)")
    return str(column), [plain(value) for value in values]


def _checked_metric(name: str, value: float) -> tuple[str, float]:
    return str(name), metric_value(name, value)


def worker_keywords(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A judger call's keywords as its worker process gets them: ``log_extra``/``log_metric`` recorded there."""
    out = dict(kwargs)
    if "log_extra" in out:
        out["log_extra"] = Recorded(functools.partial(_checked_extra, len(kwargs.get("completions", ()))))
    if "log_metric" in out:
        out["log_metric"] = Recorded(_checked_metric)
    return out


def _in_daemon_thread(fn: Callable[..., Any], kwargs: dict[str, Any], name: str, call: _Call) -> asyncio.Future:
    """Run ``fn(**kwargs)`` in a fresh daemon thread (``call.thread``); the returned future resolves on the running
    loop, with what ``fn`` raised if it raised anything (``SystemExit`` included)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if not future.done():  # it was cancelled when the call timed out
            future.set_exception(exc) if exc is not None else future.set_result(result)

    def work() -> None:
        try:
            result, exc = fn(**kwargs), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            result, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, result, exc)
        except RuntimeError:  # the loop is gone: nobody waits for this result any more
            pass

    call.thread = threading.Thread(target=work, name=f"rlflow-judger-{name}", daemon=True)
    call.thread.start()
    return future


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    loop.run_forever()
    loop.close()


def _stop(loop: asyncio.AbstractEventLoop) -> None:
    """Ask ``loop`` (running in its own thread) to stop, which also closes it (:func:`_serve`); nothing if it has
    stopped and closed already (an abandoned loop whose blocking call returned), which a finalizer may meet."""
    try:
        loop.call_soon_threadsafe(loop.stop)
    except RuntimeError:  # closed: its thread has ended
        pass


def _loop_in_thread(name: str) -> asyncio.AbstractEventLoop:
    """A new event loop running in a daemon thread called ``name``."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=_serve, args=(loop,), name=name, daemon=True).start()
    return loop


_NOT_A_REWARD = object()


def reward_number(value: Any) -> Any:
    """``value`` as a reward: a float, None (no reward), or ``_NOT_A_REWARD``. Accepts what TRL's
    ``torch.tensor(rewards, dtype=torch.float32)`` accepts of one value: numbers, booleans (1.0/0.0), numpy scalars
    and 0-d numpy arrays or torch tensors."""
    if value is None:
        return None
    if isinstance(value, (bool, numbers.Real)):
        return float(value)
    if type(value).__module__.split(".")[0] in ("numpy", "torch") and getattr(value, "ndim", None) == 0:
        item = value.item()
        if isinstance(item, (bool, numbers.Real)):
            return float(item)
    return _NOT_A_REWARD


class JudgerRunner:
    """Builds the judgers named in the config once and applies them to batches.

    Args:
        judgers: Judgers per ``data_source``: a short name, an import path, ``class_path``/``init_args`` (with an
            optional ``name`` key for the metrics), a ready callable, or a list of these; ``*`` catches every source.
        reward_weights: Weight of each judger (by name) in the summed reward; default 1.0.
        timeout: Seconds one judger may take on one batch before its samples get ``None``; None waits forever.
        defaults: Constructor arguments offered to every judger class that accepts them (e.g. ``max_tokens``).
        isolation: ``process``: user-written synchronous judgers (:func:`runs_in_worker`) run in worker processes,
            killed at the timeout; ``thread``: every judger runs in the trainer (a hung one is abandoned).
    """

    def __init__(
        self,
        judgers: dict[str, Any],
        reward_weights: dict[str, float] | None = None,
        timeout: float | None = 60.0,
        defaults: dict[str, Any] | None = None,
        isolation: str = "process",
    ) -> None:
        if not judgers:
            raise ConfigError(
                "data.judging.judgers is empty: map each data_source to a judger, e.g. {'openai/gsm8k': 'gsm8k'}; "
                f"available judgers: {', '.join(registry.available(GROUP))}"
            )
        if timeout is not None and timeout <= 0:
            raise ConfigError(f"data.judging.timeout must be positive seconds (or null to wait forever), got {timeout}")
        if isolation not in ISOLATIONS:
            raise ConfigError(f"data.judging.isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
        self.timeout = timeout
        self.isolation = isolation
        self.routes: dict[str, list[str]] = {}
        self.judgers: dict[str, Callable[..., Any]] = {}
        built: list[tuple[Any, str]] = []  # (spec, name): an identical spec on two routes is one judger
        for source, specs in judgers.items():
            specs = specs if isinstance(specs, (list, tuple)) else [specs]
            names = []
            for spec in specs:
                name = next((known for other, known in built if other == spec), None)
                if name is None:
                    build_spec = {k: v for k, v in spec.items() if k != "name"} if isinstance(spec, dict) else spec
                    judger = registry.build(GROUP, build_spec, **(defaults or {}))
                    if not callable(judger):
                        raise ConfigError(f"data.judging.judgers: {spec!r} is a {type(judger).__name__}, not a judger "
                                          "(a reward function, or a class whose instances are called)")
                    name = distinct_name(judger_name(spec, judger), self.judgers)
                    self.judgers[name] = judger
                    built.append((spec, name))
                names.append(name)
            self.routes[source] = names
        #: The keywords each judger takes (None: all, it takes ``**kwargs``).
        self.accepts = {name: accepted_keywords(judger) for name, judger in self.judgers.items()}
        self.weights = {name: 1.0 for name in self.judgers}
        for name, weight in (reward_weights or {}).items():
            if name not in self.weights:
                raise ConfigError(
                    f"data.judging.weights names judger {name!r}, which is not configured; judgers: "
                    f"{sorted(self.weights)}"
                )
            self.weights[name] = float(weight)
        self.failed_once: set[str] = set()
        self.blocked_once: set[str] = set()  # async judgers found blocking their loop (warned about once)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_lock = threading.Lock()
        self._judger_loops: dict[str, asyncio.AbstractEventLoop] = {}  # each async judger's own loop
        self._abandoned: dict[str, list[threading.Event]] = {}  # async calls that timed out: set once they end
        self._pools: dict[str, Isolated | None] = {}  # each judger's worker processes (None: in-thread)
        if any(self.in_worker(name) for name in self.judgers):
            warm_up()  # the worker processes' zygote starts while the model loads

    def __getstate__(self) -> dict[str, Any]:  # event loops, threads and processes do not pickle; they restart lazily
        state = dict(self.__dict__)
        state["_loop"], state["_loop_lock"], state["_judger_loops"], state["_abandoned"] = None, None, {}, {}
        state["_pools"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._loop_lock = threading.Lock()

    def in_worker(self, name: str) -> bool:
        """Whether judger ``name`` runs in a worker process (``isolation="process"`` and :func:`runs_in_worker`)."""
        return self.isolation == "process" and runs_in_worker(self.judgers[name])

    def pool(self, name: str) -> Isolated | None:
        """The worker processes of judger ``name`` (made on first use), or None where it runs in the trainer: not
        :meth:`in_worker`, or a judger a new process cannot load (a closure, a lambda, a function of ``__main__``:
        it runs in a thread, with a warning)."""
        with self._loop_lock:
            if name not in self._pools:
                payload, why = portable(InWorker(self.judgers[name])) if self.in_worker(name) else (None, None)
                if why is not None:
                    log.warning("judger %r runs in a thread of the trainer, where a timeout abandons it instead of "
                                "stopping it: a worker process cannot load it (%s); name it by import path", name, why)
                self._pools[name] = Isolated(payload, f"judger {name!r}") if payload is not None else None
            return self._pools[name]

    def close(self) -> None:
        """Kill the judgers' idle worker processes (a later batch starts new ones)."""
        close_all(self._pools)

    def route(self, data_source: str | None) -> list[str]:
        names = self.routes.get(data_source or "", self.routes.get("*"))
        if names is None:
            raise KeyError(
                f"no judger for data_source {data_source!r}; data.judging.judgers routes: {sorted(self.routes)} "
                "(add the source, or a '*' entry for every source)"
            )
        return names

    # ------------------------------------------------------------------------------------------- calling
    def loop(self) -> asyncio.AbstractEventLoop:
        """The runner's own event loop, running in a daemon thread (so judging works inside a running loop too,
        and async judgers may keep loop-bound clients between batches)."""
        with self._loop_lock:
            if self._loop is None or self._loop.is_closed():
                loop = _loop_in_thread("rlflow-judger-loop")
                weakref.finalize(self, _stop, loop)  # the runner is gone: end the thread
                self._loop = loop
            return self._loop

    def judger_loop(self, name: str) -> asyncio.AbstractEventLoop:
        """The event loop async judger ``name`` runs on: the one of its earlier batches, unless a call of it that
        timed out is still running (it could not even be cancelled: it blocks that loop), then a fresh one (the
        blocked loop's thread is abandoned, like a hung plain judger's)."""
        loop = self._judger_loops.get(name)
        blocked = any(not ended.is_set() for ended in self._abandoned.pop(name, []))
        if loop is None or loop.is_closed() or blocked:
            if loop is not None and not loop.is_closed():
                (log.debug if name in self.blocked_once else log.warning)(
                    "async judger %r still blocks its event loop after its timeout (a blocking call inside "
                    "'async def'?); it gets a new loop (logged once per judger)", name)
                self.blocked_once.add(name)
                _stop(loop)  # runs once (if ever) the blocking call returns
            loop = _loop_in_thread(f"rlflow-judger-{name}")
            weakref.finalize(self, _stop, loop)
            self._judger_loops[name] = loop
        return loop

    def _in_worker(self, pool: Isolated, kwargs: dict[str, Any]) -> Outcome:
        """One call in ``pool``'s worker process, its ``log_extra``/``log_metric`` records replayed on ``kwargs``'s."""
        outcome = pool.call((), worker_keywords(kwargs), self.timeout)
        for key, args in outcome.records:
            try:
                kwargs[key](*args)
            except Exception as exc:  # noqa: BLE001 - checked in the worker already; a failure of the call if not
                outcome.error = outcome.error or exc
        return outcome

    async def _in_pool(self, name: str, pool: Isolated, kwargs: dict[str, Any],
                       call: _Call) -> tuple[Any, BaseException | None]:
        outcome = await _in_daemon_thread(self._in_worker, {"pool": pool, "kwargs": kwargs}, name, call)
        if outcome.killed:
            call.killed = True
            return None, JudgerTimeout(f"judger {name!r} did not answer within data.judging.timeout={self.timeout} s;"
                                       " its worker process was killed", killed=True)
        if outcome.error is not None:
            return None, outcome.error
        out, call.reported = outcome.value
        return out, None

    def _pooled(self, name: str, kwargs: dict[str, Any]) -> Isolated | None:
        """Judger ``name``'s worker processes for a call with ``kwargs``; None: this call runs in the trainer (it
        passes a keyword of :data:`TRAINER_ONLY`)."""
        return None if not TRAINER_ONLY.isdisjoint(kwargs) else self.pool(name)

    async def _invoke(self, name: str, kwargs: dict[str, Any], call: _Call) -> tuple[Any, BaseException | None]:
        judger = self.judgers[name]
        try:
            pool = self._pooled(name, kwargs)
            if pool is not None:
                return await self._in_pool(name, pool, kwargs, call)
            if writes_user_code(judger):  # in the trainer: its own copy of the samples, which it may change at will
                kwargs = private_copies(kwargs)
            if is_async(judger):
                async def run() -> tuple[Any, BaseException | None]:
                    try:
                        return await judger(**kwargs), None
                    except asyncio.CancelledError:  # this call timed out
                        raise
                    except BaseException as exc:  # noqa: BLE001 - SystemExit inside a judger must not end its loop
                        return None, exc
                    finally:
                        call.ended.set()  # on the judger's loop, however this call's waiting ended

                loop = self.judger_loop(name)
                return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), loop))
            out = await _in_daemon_thread(judger, kwargs, name, call)
            if inspect.isawaitable(out):  # a plain callable that hands back a coroutine
                out = await out
            return out, None
        except asyncio.CancelledError:  # wait_for's timeout: _call reports it
            raise
        except BaseException as exc:  # noqa: BLE001 - a failing judger costs its samples' rewards, not the run
            return None, exc

    async def _call(self, name: str, kwargs: dict[str, Any], call: _Call) -> tuple[Any, BaseException | None]:
        bound = self.timeout
        if bound is not None and self._pooled(name, kwargs) is not None:
            bound += KILL_MARGIN  # the worker is killed at the timeout itself; this wait is for a wedged pipe
        try:  # only wait_for's own timeout lands here: the judger's exceptions are caught in _invoke
            return await asyncio.wait_for(self._invoke(name, kwargs, call), bound)
        except asyncio.TimeoutError:
            if is_async(self.judgers[name]):
                self._abandoned.setdefault(name, []).append(call.ended)
            elif call.thread is not None:
                _abandoned_threads.add(call.thread)
            return None, JudgerTimeout(f"judger {name!r} did not answer within data.judging.timeout={self.timeout} s")

    async def _call_all(self, jobs: dict[str, dict[str, Any]],
                        calls: dict[str, _Call]) -> dict[str, tuple[Any, BaseException | None]]:
        results = await asyncio.gather(*(self._call(name, kwargs, calls[name]) for name, kwargs in jobs.items()))
        return dict(zip(jobs, results))

    def keywords(self, name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
        """What judger ``name`` is called with for ``kwargs``: TRL's ``trainer_state``, ``log_extra`` and
        ``log_metric`` added where ``kwargs`` has none (:func:`~rlflow.judgers.context.before_training`'s state;
        what is logged is dropped), then only the keywords the judger takes."""
        if "trainer_state" not in kwargs:
            n = len(kwargs.get("completions", ()))
            kwargs = {**kwargs, **JudgerLogs(n).keywords(range(n), before_training())}
        return select_keywords(kwargs, self.accepts[name])

    def call_all(self, jobs: dict[str, dict[str, Any]],
                 calls: dict[str, _Call] | None = None) -> dict[str, tuple[Any, BaseException | None]]:
        """Run every ``name -> kwargs`` job concurrently (each judger given :meth:`keywords`); return
        ``name -> (output, exception or None)`` (``calls``, if given, gets each job's :class:`_Call`).

        Judgers running in worker processes first get a loaded worker each (up to
        :data:`rlflow.isolation.START_TIMEOUT` seconds; one that cannot start fails its job), so the timeout counts
        the call alone. The wait is bounded by the timeout and :data:`GRACE` seconds (and the kill margin): past it
        (the runner's own event loop no longer answers) every job counts as timed out and the next batch gets a fresh
        loop."""
        calls = calls if calls is not None else {}
        if not jobs:
            return {}
        jobs = {name: self.keywords(name, kwargs) for name, kwargs in jobs.items()}
        calls.update({name: _Call() for name in jobs})
        failed = {}
        for name, kwargs in jobs.items():
            pool = self._pooled(name, kwargs)
            error = pool.prepare() if pool is not None else None
            if error is not None:
                failed[name] = (None, error)
        jobs = {name: kwargs for name, kwargs in jobs.items() if name not in failed}
        if not jobs:
            return failed
        future = asyncio.run_coroutine_threadsafe(self._call_all(jobs, calls), self.loop())
        bound = None if self.timeout is None else self.timeout + GRACE + KILL_MARGIN
        try:
            return {**future.result(bound), **failed}
        except concurrent.futures.TimeoutError:
            future.cancel()
            with self._loop_lock:
                self._loop = None  # the stuck loop's thread is abandoned (a daemon)
            error = JudgerTimeout(f"the judgers' event loop did not answer within data.judging.timeout={self.timeout}"
                                  f" s + {GRACE:g} s")
            return {**{name: (None, error) for name in jobs}, **failed}

    def check(self, name: str, out: Any, n: int) -> list[float | None]:
        """Check one judger's output for ``n`` samples: a list of numbers or None (NaN counts as None)."""
        if out is None:
            return [None] * n
        if isinstance(out, (str, bytes, dict)) or not hasattr(out, "__iter__"):
            raise JudgerContractError(
                f"judger {name!r} returned a {type(out).__name__}; it must return a list of {n} rewards")
        out = list(out)
        if len(out) != n:
            raise JudgerContractError(f"judger {name!r} returned {len(out)} rewards for {n} completions")
        checked: list[float | None] = []
        for value in out:
            number = reward_number(value)
            if number is _NOT_A_REWARD:
                raise JudgerContractError(
                    f"judger {name!r} returned {value!r} ({type(value).__name__}); rewards must be numbers or None"
                )
            checked.append(None if number is None or math.isnan(number) else number)
        return checked

    def report_failure(self, name: str, exc: BaseException, n: int) -> None:
        if name in self.failed_once:
            log.debug("judger %r failed again on %d sample(s): %s", name, n, one_line(exc))
            return
        self.failed_once.add(name)
        log.warning(
            "judger %r failed on %d sample(s); they get no reward from it (counted in judger/failures, "
            "logged once per judger): %s", name, n, one_line(exc), exc_info=exc,
        )

    def own_failures(self, name: str) -> tuple[list[int], int]:
        """The samples judger ``name`` gave None because of an error in its last call (in the trainer):
        :func:`reported_failures`."""
        return reported_failures(self.judgers[name])

    # ------------------------------------------------------------------------------------------- judging
    def judge(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        columns: dict[str, Sequence[Any]],
        state: RunState | None = None,
    ) -> JudgeResult:
        """Judge a batch: each judger gets its samples in TRL's keywords, with ``trainer_state`` (``state``, the
        step being judged; :func:`~rlflow.judgers.context.before_training` if None), ``log_extra`` and
        ``log_metric``."""
        n = len(completions)
        state = state if state is not None else before_training()
        sources = columns.get("data_source") or [None] * n
        routes = [self.route(sources[i]) for i in range(n)]
        per_judger: dict[str, list[float | None]] = {name: [None] * n for name in self.judgers}
        logs = JudgerLogs(n)
        jobs, indices = {}, {}
        for name in self.judgers:
            idx = [i for i in range(n) if name in routes[i]]
            if not idx:
                continue
            indices[name] = idx
            jobs[name] = self.keywords(name, {
                "prompts": [prompts[i] for i in idx],
                "completions": [completions[i] for i in idx],
                "completion_ids": [completion_ids[i] for i in idx],
                **{key: [values[i] for i in idx] for key, values in columns.items()},
                **logs.keywords(idx, state),
            })
        failed: list[tuple[str, ...]] = [()] * n
        stats: dict[str, JudgerStats] = {}
        calls: dict[str, _Call] = {}
        outputs = self.call_all(jobs, calls)
        logs.close()  # a judger abandoned after its timeout logs nothing more into this batch
        for name, (out, exc) in outputs.items():
            idx = indices[name]
            call = calls.get(name) or _Call()
            if exc is not None:
                self.report_failure(name, exc, len(idx))
                lost, counted = list(range(len(idx))), len(idx)
            else:
                values = self.check(name, out, len(idx))
                lost = [p for p, v in enumerate(values) if v is not None and math.isinf(v)]
                if lost:  # a failure of those samples (e.g. a division by zero), not a reward to train on
                    exc = ValueError(f"it returned {values[lost[0]]} for {len(lost)} sample(s); infinite rewards "
                                     "count as failed")
                    self.report_failure(name, exc, len(lost))
                    for p in lost:
                        values[p] = None
                for i, value in zip(idx, values):
                    per_judger[name][i] = value
                own, own_count = call.reported if call.reported is not None else self.own_failures(name)
                lost, counted = lost + own, len(lost) + own_count
            stats[name] = JudgerStats(len(idx), counted, one_line(exc) if exc is not None else None,
                                      tuple(jobs[name]), int(call.killed))
            for p in lost:  # positions in this judger's share of the batch
                failed[idx[p]] += (name,)
        rewards = []
        for i in range(n):
            parts = [
                self.weights[name] * per_judger[name][i] for name in self.judgers if per_judger[name][i] is not None
            ]
            rewards.append(sum(parts) if parts else 0.0)
        return JudgeResult(rewards, per_judger, judge_metrics(per_judger, stats), failed, stats, logs.extra,
                           logs.metrics)
