"""The judge panel: every judger of a run, routed per data source, turning completions into rewards.

:class:`SourceJudgers` routes a batch whose rows come from several sources, each with the data-level routing
(``data.judging.judgers``) or its own (a source's ``judgers``), and merges the per-sample results. :class:`JudgePanel`
is the part the datamodule composes: it checks before training that every row can be judged, and decodes and
judges sampled completions in TRL's layout (chat completions for chat prompts).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from rlflow.config_error import ConfigError
from rlflow.data.dataset import RESERVED_COLUMNS, DataError, PromptRecord
from rlflow.data.sources import DataSource
from rlflow.judgers.context import RunState, environments_of, required_keywords
from rlflow.judgers.runner import JudgeResult, JudgerRunner, merge_results

log = logging.getLogger(__name__)



def column_hint(missing: list[str]) -> str:
    """How a missing judger column is usually given, for lines ``judger 'x' needs column 'c'``."""
    if any(line.endswith("column 'ground_truth'") for line in missing):
        return " (XTuner's rows carry it as reward_model.ground_truth; TRL's datasets often call it solution or answer)"
    return " (a column of another name is passed on by the function judger's rename: {<its name>: <the data's>})"

class SourceJudgers:
    """Judges batches mixing sources: each source's rows go to its own judgers, the rest to ``data.judging.judgers``.

    Args:
        judgers: The data-level ``{data_source: spec}`` routing (``data.judging.judgers``).
        reward_weights: Weight of each judger by name, over all sources' judgers.
        sources: The configured sources; those with ``judgers`` get their own :class:`JudgerRunner`.
        **runner_kwargs: Passed to every :class:`JudgerRunner` (``timeout``, ``defaults``...).
    """

    def __init__(self, judgers: dict[str, Any], reward_weights: dict[str, float] | None, sources: Sequence[DataSource],
                 **runner_kwargs: Any) -> None:
        self.default = JudgerRunner(judgers, **runner_kwargs)
        self.runners: dict[str, Any] = {}
        routing: dict[str, dict[str, Any]] = {}
        for source in sources:
            routes = source.judger_routes()
            if routes is None:
                continue
            if source.name in self.runners:
                if routing[source.name] != routes:
                    raise ConfigError(
                        f"two data sources are named {source.name!r} with different judgers; give them distinct names"
                    )
                continue
            self.runners[source.name] = JudgerRunner(routes, **runner_kwargs)
            routing[source.name] = routes
        runners = [self.default, *self.runners.values()]
        known = sorted({name for r in runners for name in r.weights})
        for name, weight in (reward_weights or {}).items():
            if name not in known:
                raise ConfigError(
                    f"data.judging.weights names judger {name!r}, which is not configured; judgers: {known}")
            for runner in runners:
                if name in runner.weights:
                    runner.weights[name] = float(weight)

    def close(self) -> None:
        """End every runner's idle judger worker processes (a later batch starts new ones)."""
        for runner in (self.default, *self.runners.values()):
            runner.close()

    def judge(self, origins: Sequence[str], prompts: Sequence[Any], completions: Sequence[Any],
              completion_ids: Sequence[Sequence[int]], columns: dict[str, Sequence[Any]], default: Any = None,
              state: RunState | None = None) -> JudgeResult:
        """Like :meth:`JudgerRunner.judge`, with ``origins[i]`` naming the source of sample ``i``.

        ``default`` replaces the data-level runner (the panel passes its ``default``, which may be swapped).
        """
        default = default if default is not None else self.default
        groups: dict[int, list[int]] = {}
        runners: dict[int, Any] = {}
        for i, origin in enumerate(origins):
            runner = self.runners.get(origin, default)
            groups.setdefault(id(runner), []).append(i)
            runners[id(runner)] = runner
        if len(groups) == 1:
            return next(iter(runners.values())).judge(prompts, completions, completion_ids, columns, state)
        parts = [(idx, runners[key].judge(
            [prompts[i] for i in idx], [completions[i] for i in idx], [completion_ids[i] for i in idx],
            {k: [v[i] for i in idx] for k, v in columns.items()}, state,
        )) for key, idx in groups.items()]
        return merge_results(len(completions), parts)


class JudgePanel:
    """Scores completions with the run's judgers; the datamodule's reward stage.

    Args:
        judgers: The data-level ``{data_source: spec}`` routing (``data.judging.judgers``).
        reward_weights: Weight of each judger by name.
        sources: Every configured train and eval source (sources with ``judgers`` get their own routing).
        timeout: Seconds one judger may take on one batch (``data.judging.timeout``).
        max_tokens: The completion budget, a default for judgers that take it (``overlong``).
        max_failure_rate: Share of a step's samples one judger may fail on (``data.judging.max_failure_rate``;
            None: any share short of all of them; :func:`~rlflow.judgers.runner.stop_if_unusable` reads it).
        isolation: Where user-written judgers run (``data.judging.isolation``: ``process`` or ``thread``).
    """

    def __init__(self, judgers: dict[str, Any], reward_weights: dict[str, float] | None,
                 sources: Sequence[DataSource], timeout: float | None = 60.0, max_tokens: int | None = None,
                 max_failure_rate: float | None = None, isolation: str = "process") -> None:
        defaults = {"max_tokens": max_tokens} if max_tokens is not None else {}
        self.routing = SourceJudgers(judgers, reward_weights, sources, timeout=timeout, defaults=defaults,
                                     isolation=isolation)
        self.max_failure_rate = max_failure_rate
        self.default: JudgerRunner = self.routing.default  # rows of sources without their own judgers
        self.tokenizer: Any = None
        #: Every column of the rows :meth:`check_rows` saw: each is passed to the judgers of every batch (None for a
        #: row without it), so a column no row of one batch has is still a keyword, as with TRL's datasets.
        self.known_columns: set[str] = set()

    def close(self) -> None:
        """End the judgers' idle worker processes, at the end of a run (a later batch starts new ones)."""
        self.routing.close()
        if self.default is not self.routing.default:
            self.default.close()

    def runner_for(self, record: PromptRecord) -> JudgerRunner:
        return self.routing.runners.get(record.origin, self.default)

    def weights(self) -> dict[str, float]:
        """Every configured judger's name and weight, sorted by name (the same on every rank)."""
        found: dict[str, float] = {}
        for runner in (self.default, *self.routing.runners.values()):
            for name, weight in runner.weights.items():
                found.setdefault(name, weight)
        return dict(sorted(found.items()))

    def check_rows(self, records: list[PromptRecord], split: str) -> None:
        """Before any generation: every row has a judger for its ``data_source`` and the columns those judgers need
        (``required_columns``, e.g. gsm8k's ``ground_truth``); else one DataError naming each row's file:line."""
        problems, count = [], 0
        columns_seen: dict[tuple[int, str], set[str]] = {}  # (runner, judger) -> the columns of the rows it judges
        for record in records:
            runner = self.runner_for(record)
            try:
                names = runner.route(record.data_source)
            except KeyError as exc:
                problem = f"{record.source}: {exc.args[0] if exc.args else exc}"
            else:
                for name in names:
                    columns_seen.setdefault((id(runner), name), set()).update(record.columns)
                self.known_columns.update(record.columns)
                missing = [f"judger {name!r} needs column {col!r}" for name in names
                           for col in getattr(runner.judgers[name], "required_columns", ())
                           if record.columns.get(col) is None]
                if not missing:
                    continue
                problem = f"{record.source}: {'; '.join(missing)}, which the row lacks{column_hint(missing)}"
            count += 1
            if len(problems) < 10:
                problems.append(problem)
        unfed = self.unfed_parameters(columns_seen, split)
        if unfed:
            raise DataError(f"{split} data: " + "; ".join(unfed))
        if problems:
            more = f"\n  ... and {count - len(problems)} more" if count > len(problems) else ""
            raise DataError(
                f"{count} {split} row(s) cannot be judged; fix them (or data.judging.judgers) before training:\n  "
                + "\n  ".join(problems)
                + more
            )

    def unfed_parameters(self, columns_seen: dict[tuple[int, str], set[str]], split: str) -> list[str]:
        """A line per judger with a required parameter (a TRL reward function's ``solution``) that neither the
        judger call's own keywords nor any column of the rows routed to it would fill: the call would fail on every
        sample of the first step. A column some rows lack is passed as None there, as TRL does."""
        lines = []
        for runner in (self.default, *self.routing.runners.values()):
            for name, judger in runner.judgers.items():
                seen = columns_seen.get((id(runner), name))
                if seen is None:
                    continue
                unfed = sorted(required_keywords(judger) - RESERVED_COLUMNS - seen)
                if unfed:
                    lines.append(f"judger {name!r} requires the parameter(s) {', '.join(unfed)}, which no {split} row "
                                 f"it judges has as a column (columns: {', '.join(sorted(seen)) or 'none'}); add the "
                                 "column, give the parameter a default, or rename a column with the function judger")
        return lines

    def answers(self, records: list[PromptRecord], texts: list[str], k: int) -> list[list[str | None] | None]:
        """Per record, the final answer each of its ``k`` completions (``texts``, record-major) states, by the first
        of the record's judgers with an ``answer`` method (:mod:`rlflow.judgers.base`), for ``eval/maj@k``; None for a
        record none of whose judgers states answers. An ``answer`` that raises counts as no answer stated."""
        out: list[list[str | None] | None] = []
        for i, record in enumerate(records):
            runner = self.runner_for(record)
            judger = next(
                (
                    runner.judgers[name]
                    for name in runner.route(record.data_source)
                    if callable(getattr(runner.judgers[name], "answer", None))
                ),
                None,
            )
            out.append(None if judger is None else [_stated(judger, t) for t in texts[i * k : (i + 1) * k]])
        return out

    def judge(self, records: list[PromptRecord], completions: list[Any], k: int,
              state: RunState | None = None) -> tuple[JudgeResult, list[str]]:
        """Decode and judge ``k`` completions per record: the :class:`JudgeResult` and the decoded texts.

        ``state`` is the judgers' ``trainer_state`` (the step being judged)."""
        if self.tokenizer is None:
            raise RuntimeError("JudgePanel.tokenizer is not set; the datamodule sets it in setup()")
        ids = [c.token_ids for c in completions]
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        reps = [r for r in records for _ in range(k)]
        shaped = [
            [{"role": "assistant", "content": t}] if isinstance(r.prompt, list) else t for r, t in zip(reps, texts)
        ]
        keys = sorted({key for r in records for key in r.columns} | self.known_columns)
        columns = {key: [r.columns.get(key) for r in reps] for key in keys}
        if any(getattr(c, "messages", None) is not None for c in completions):
            # multi-turn: judgers see the whole conversation after the prompt, the texts keep the chat markup (the
            # samples table and trajectories.jsonl show every turn, tool calls and results), ``env_reward`` is the
            # environment's summed reward (the ``env_reward`` judger reads it)
            shaped = [c.messages if c.messages is not None else s for c, s in zip(completions, shaped)]
            texts = self.tokenizer.batch_decode(ids, skip_special_tokens=False)
            columns["env_reward"] = [getattr(c, "env_reward", None) for c in completions]
            environments = environments_of(completions)  # TRL's ``environments`` keyword
            if environments is not None:
                columns["environments"] = environments
        result = self.routing.judge(
            [r.origin for r in reps], [r.prompt for r in reps], shaped, ids, columns, default=self.default, state=state
        )
        return result, texts


def _stated(judger: Any, text: str) -> str | None:
    """``judger.answer(text)`` as a string, or None where it states none or raises (logged once per judger)."""
    try:
        answer = judger.answer(text)
    except Exception as exc:  # noqa: BLE001 - a judger's bug must not stop the evaluation
        if not getattr(judger, "_rlflow_answer_warned", False):
            log.warning(
                "%s.answer raised %s: %s; its samples count as stating no answer in eval/maj@k",
                type(judger).__name__,
                type(exc).__name__,
                exc,
            )
            with contextlib.suppress(AttributeError, TypeError):
                judger._rlflow_answer_warned = True
        return None
    return None if answer is None else str(answer)
