"""``ExperienceMaker``: one rollout step, from a batch of prompts to scored experience in the replay buffer.

It is given every collaborator explicitly when the datamodule binds the policy: the rollout backend (or the split
rollout that shares it with the generator process), the pipeline that generates ahead (``data.pipeline``), the
multi-turn driver, the judge panel, the advantage estimator, dynamic sampling, the replay buffer, the sampling
settings and the prompt set with its sampler. Reading top to bottom, :meth:`ExperienceMaker.make` is the recipe:

1. generate ``k`` completions per prompt (now, or take those generated ahead by the pipeline);
2. judge them (overlapped with generation where the backend streams), the judgers given the step as TRL's
   ``trainer_state`` (:func:`rlflow.judgers.context.run_state`); a judger that cannot work (it failed on every
   sample, or on more than ``data.judging.max_failure_rate``) stops the run here, before anything trains on it;
3. with dynamic sampling, replace groups without a learning signal;
4. compute group-relative advantages over every rank's batch;
5. stamp each experience with the policy version that sampled it and put it in the replay buffer;
6. return the step's metrics (TRL's names, and the judgers' ``log_metric`` means) and its sample rows (with the
   judgers' ``log_extra`` columns).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlflow.advantages.base import AdvantageEstimator, estimate_global
from rlflow.data.dataset import PromptRecord
from rlflow.data.dynamic_sampling import DynamicSampling, Groups
from rlflow.data.experience import Experience, RolloutStep
from rlflow.data.prompts import PromptSet
from rlflow.data.replay_buffer import ReplayBuffer
from rlflow.data.rollout_metrics import rollout_metrics
from rlflow.data.sources import per_source_means
from rlflow.judgers.context import RunState, run_state
from rlflow.judgers.overlap import generate_and_judge
from rlflow.judgers.panel import JudgePanel
from rlflow.judgers.runner import JudgeResult, stop_if_unusable
from rlflow.log import warn
from rlflow.models.vision import ImageInputs, rollout_prompts
from rlflow.rollout.base import RolloutBackend, SamplingParams
from rlflow.rollout.draws import isolated_draws
from rlflow.rollout.multiturn import MultiTurn, RecordsRollout, multiturn_metrics
from rlflow.rollout.pipeline import RolloutPipeline, peek_next_batch
from rlflow.training.distributed import all_gather
from rlflow.training.evaluation import eval_seed, isolated_rng


def _same(flag: bool) -> bool:
    return flag


@dataclass
class Ranks:
    """This process's place among the data-parallel ranks, and the one collective a rollout step needs."""

    rank: int = 0
    world_size: int = 1
    #: Whether ``flag`` holds on any rank (every rank must run the same dynamic-sampling rounds, and stop at the
    #: same step where a judger cannot work).
    any_true: Callable[[bool], bool] = _same

    def share(self, batch: list[Any]) -> list[Any]:
        """This rank's prompts of a global batch: a contiguous slice, so a group never spans two ranks."""
        per = len(batch) // self.world_size
        return batch[self.rank * per: (self.rank + 1) * per]


class JudgerNotes:
    """What the judgers logged while one rollout step (or evaluation batch) was judged, over all its rounds: the
    ``log_extra`` columns of each completion and the ``log_metric`` values (TRL's keywords)."""

    def __init__(self) -> None:
        self.columns: dict[str, None] = {}  # every column logged, in order
        self.values: dict[int, dict[str, Any]] = {}  # id(completion) -> its logged columns
        self.metrics: dict[str, list[float]] = {}

    def add(self, completions: list[Any], result: JudgeResult) -> None:
        """Keep what the judgers logged while judging ``completions`` (``result``, in the same order)."""
        self.columns.update(dict.fromkeys(result.extra))
        for i, completion in enumerate(completions):
            self.values[id(completion)] = {column: values[i] for column, values in result.extra.items()}
        for name, values in result.logged.items():
            self.metrics.setdefault(name, []).extend(values)

    def rows(self, completions: list[Any]) -> list[dict[str, Any]]:
        """Per completion, every column logged (None where it was not logged for that completion)."""
        return [{column: self.values.get(id(c), {}).get(column) for column in self.columns} for c in completions]

    def means(self) -> dict[str, float]:
        """Each ``log_metric`` name's mean over the step."""
        return {name: sum(values) / len(values) for name, values in self.metrics.items()}


@dataclass
class EvalPlan:
    """How evaluation batches are sampled and scored (``data.eval``)."""

    sampling: SamplingParams
    k: int
    pass_threshold: float
    seed: int


#: Columns of the loggers themselves (the CSV logger's, W&B's x-axes): a ``log_metric`` of these names is dropped.
LOGGER_COLUMNS = ("step", "epoch", "global_step", "trainer/global_step")


def merge_logged_metrics(metrics: dict[str, float], logged: dict[str, float], warned: set[str]) -> None:
    """Add the judgers' ``log_metric`` means to ``metrics``; one named like a built-in metric of the rollout step
    gives way to it, and one named like a logger's own column (``step``, ``epoch``) is dropped, each with a
    warning once per run (``warned``: the names warned about)."""
    for name, mean in logged.items():
        taken = name in LOGGER_COLUMNS or name in metrics
        if taken and f"metric:{name}" not in warned:
            warned.add(f"metric:{name}")
            warn(f"a judger's log_metric({name!r}, ...) is not logged: {name!r} is "
                 + ("a logger's own column" if name in LOGGER_COLUMNS else "a metric of the rollout step")
                 + "; give it another name")
        if not taken:
            metrics[name] = mean


def warn_silent_judgers(judged: JudgeResult, step: int, warned: set[str]) -> None:
    """Warn, once per judger and run, about a judger that returned no reward (None or NaN) for any of its samples
    of a rollout step without failing: those samples train on the other judgers' rewards, or on 0.0."""
    for name, stats in sorted(judged.judgers.items()):
        values = judged.per_judger.get(name, [])
        silent = stats.samples > 0 and not stats.failed and values and all(v is None for v in values)
        if silent and f"judger:{name}" not in warned:
            warned.add(f"judger:{name}")
            warn(f"rollout step {step}: judger {name!r} returned no reward (None or NaN) for any of its "
                 f"{stats.samples} samples; a sample no judger scores trains with reward 0.0 (judger/unscored "
                 "counts them; warned once per judger)")


class ExperienceMaker:
    """Generates, judges and scores rollout steps; see the module docstring for the order of the parts."""

    def __init__(
        self, *, backend: RolloutBackend, judges: JudgePanel, advantage: AdvantageEstimator, buffer: ReplayBuffer,
        sampling: SamplingParams, k: int, prompts: PromptSet, sampler: Any, ranks: Ranks, tokenizer: Any,
        evaluation: EvalPlan, pipeline: RolloutPipeline | None = None, split: RolloutBackend | None = None,
        multiturn: MultiTurn | None = None, dynamic_sampling: DynamicSampling | None = None,
        image_inputs: ImageInputs | None = None, overlap_judging: bool = True, skip_solved: bool = False,
        max_steps: int = -1, max_epochs: int | None = None,
    ) -> None:
        self.backend = backend  # the bound backend (its seeded draws; multi-turn rollouts drive it turn by turn)
        self.single_turn = split or backend  # what single-turn rollouts run on: the split rollout, else the backend
        self.judges, self.advantage, self.buffer = judges, advantage, buffer
        self.sampling, self.k, self.prompts, self.sampler = sampling, k, prompts, sampler
        self.ranks, self.tokenizer, self.evaluation = ranks, tokenizer, evaluation
        self.pipeline, self.multiturn, self.dynamic_sampling = pipeline, multiturn, dynamic_sampling
        self.image_inputs, self.overlap_judging, self.skip_solved = image_inputs, overlap_judging, skip_solved
        self.max_steps, self.max_epochs = max_steps, max_epochs  # the run's bounds (trainer_state's)
        self._record_index: dict[int, int] | None = None  # id(train record) -> its index (skip_solved)
        self._warned: set[str] = set()  # judgers and log_metric names warned about (once each per run)

    # ------------------------------------------------------------------------------------------ the step
    def make(self, batch: list[PromptRecord], policy_version: int, step: int, progress: Any = None) -> RolloutStep:
        """Generate, judge and score one rollout step of the global ``batch``; put the experience in the buffer."""
        k = self.k
        records = self.ranks.share(batch)
        backend, pipelined = self.backend_for(records), {}
        if self.pipeline is not None:  # data.pipeline.max_staleness > 0: generated ahead, in another process
            upcoming = self.ranks.share([self.prompts.records[i] for i in peek_next_batch(self.sampler)])
            backend, policy_version, pipelined = self.pipeline.take(records, policy_version, step, self.sampling, k,
                                                                    upcoming)
        state, notes = self.run_state(step), JudgerNotes()
        groups, judged, texts, gen_time = generate_and_judge(
            backend, functools.partial(self.judges.judge, state=state), records, self.sampling, k,
            self.overlap_judging, progress, prompts=self.prompt_inputs(records))
        stop_if_unusable(judged, self.judges.max_failure_rate, step, self.ranks.any_true)
        warn_silent_judgers(judged, step, self._warned)
        chosen = Groups(records, [c for group in groups for c in group], judged.rewards, texts, judged.failed)
        notes.add(chosen.completions, judged)
        metrics = dict(judged.metrics)
        if self.dynamic_sampling is not None:
            chosen, sampling_metrics, extra_time = self.dynamic_sampling.fill(
                chosen, k, step, self.ranks.rank, len(self.prompts.records),
                functools.partial(self.regenerate, state=state, notes=notes), self.ranks.any_true)
            metrics.update(sampling_metrics)
            gen_time += extra_time
        reward_t = torch.tensor(chosen.rewards, dtype=torch.float32)
        lengths = torch.tensor([c.num_sampled for c in chosen.completions])
        components = self.reward_components(judged.per_judger) if self.needs_components else None
        advantages = estimate_global(self.advantage, reward_t, k, lengths=lengths, components=components).tolist()
        experiences = self.experiences(chosen, advantages, policy_version)
        self.buffer.add(experiences)
        metrics.update(rollout_metrics(reward_t, chosen.completions, k,
                                       sum(len(r.prompt_ids) for r in chosen.records) * k, gen_time))
        metrics.update(multiturn_metrics(chosen.completions))
        metrics.update(pipelined)
        metrics["data/dropped_prompts"] = float(self.prompts.dropped)
        if self.skip_solved:  # the step's own prompts as first judged (dynamic sampling drops solved groups)
            metrics.update(self.record_solved(records, judged.rewards))
        sources = [r.data_source or r.origin for r in chosen.records for _ in range(k)]
        metrics.update(per_source_means(sources, chosen.rewards, "reward"))
        merge_logged_metrics(metrics, notes.means(), self._warned)
        rows = self.sample_rows(step, chosen.records, chosen.texts, experiences, notes.rows(chosen.completions))
        return RolloutStep(experiences, metrics, rows)

    def run_state(self, step: int) -> RunState:
        """The judgers' ``trainer_state`` while rollout step ``step`` (rollout steps trained so far) is judged."""
        steps_per_epoch = len(self.sampler) if self.sampler is not None else 1
        return run_state(step, self.max_steps, self.max_epochs, steps_per_epoch, self.ranks.rank,
                         int(os.environ.get("LOCAL_RANK", self.ranks.rank)))

    def experiences(self, chosen: Groups, advantages: list[float], policy_version: int) -> list[Experience]:
        """One :class:`Experience` per completion, stamped with the version that sampled it (its oldest token's)."""
        k = self.k
        return [
            Experience(
                prompt_ids=c.prompt_ids or chosen.records[i // k].prompt_ids, completion_ids=c.token_ids,
                rollout_logprobs=c.logprobs, sampled_mask=c.mask,
                reward=chosen.rewards[i], advantage=advantages[i], group=i // k, finish_reason=c.finish_reason,
                policy_version=min(c.token_versions) if c.token_versions else policy_version,
                data_source=chosen.records[i // k].data_source, images=chosen.records[i // k].images,
                token_versions=c.token_versions,
                info={"judgers_failed": list(chosen.failed[i])} if chosen.failed and chosen.failed[i] else {},
            ) for i, c in enumerate(chosen.completions)
        ]

    def backend_for(self, records: list[PromptRecord]) -> RolloutBackend:
        """The backend that generates ``records``: the split rollout or the backend, or the multi-turn view."""
        if self.multiturn is not None:
            return RecordsRollout(self.multiturn, self.backend, records)
        return self.single_turn

    def prompt_inputs(self, records: list[PromptRecord]) -> list[Any]:
        """What the backend is given for ``records``: token ids, with the images of prompts that have any."""
        return rollout_prompts(records, self.image_inputs)

    def regenerate(self, indices: list[int], generator: torch.Generator, state: RunState | None = None,
                   notes: JudgerNotes | None = None) -> Groups:
        """Generate and judge the training prompts at ``indices`` (dynamic sampling's extra rounds; ``state`` is the
        judgers' ``trainer_state``, ``notes`` keeps what they log)."""
        records = [self.prompts.records[i] for i in indices]
        groups = self.backend_for(records).generate(self.prompt_inputs(records), self.sampling, n=self.k)
        completions = [c for group in groups for c in group]
        result, texts = self.judges.judge(records, completions, self.k, state)
        if notes is not None:
            notes.add(completions, result)
        return Groups(records, completions, result.rewards, texts, result.failed)

    # ------------------------------------------------------------------------------------------ rewards
    @property
    def needs_components(self) -> bool:
        """Whether the advantage estimator reads each judger's reward (GDPO), not only their weighted sum."""
        return bool(getattr(self.advantage, "needs_components", False))

    def reward_components(self, per_judger: dict[str, list[float | None]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N, judgers]`` rewards of every configured judger (NaN where it gave none) and their weights."""
        weights = self.judges.weights()
        n = len(next(iter(per_judger.values()))) if per_judger else 0
        columns = [[float("nan") if v is None else float(v) for v in per_judger.get(name, [None] * n)]
                   for name in weights]
        return (torch.tensor(columns, dtype=torch.float32).t().reshape(n, len(weights)),
                torch.tensor(list(weights.values()), dtype=torch.float32))

    def record_solved(self, records: list[PromptRecord], rewards: list[float]) -> dict[str, float]:
        """``skip_solved``: tell the sampler which of every rank's groups were solved (all ``k`` rewards at least
        the pass threshold; ``records`` is this rank's share of the batch, a collective); returns
        ``data/solved_prompts`` (marked so far) and ``data/skipped_prompts`` (left out of this epoch)."""
        if self._record_index is None:
            self._record_index = {id(r): i for i, r in enumerate(self.prompts.records)}
        k, bar = self.k, self.evaluation.pass_threshold
        pairs = torch.tensor([[self._record_index[id(r)], all(x >= bar for x in rewards[g * k:(g + 1) * k])]
                              for g, r in enumerate(records)], dtype=torch.long).reshape(-1, 2)
        # every rank's groups (equal shares of the batch), so all samplers leave out the same prompts
        for index, solved in all_gather(pairs).tolist():
            self.sampler.record(index, bool(solved))
        return {"data/solved_prompts": float(len(self.sampler.solved)),
                "data/skipped_prompts": float(len(self.sampler.left_out(self.sampler.epoch)))}

    # -------------------------------------------------------------------------------------------- rows
    def sample_rows(self, step: int, records: list[PromptRecord], texts: list[str], experiences: list[Experience],
                    extra: list[dict[str, Any]] | None = None) -> list[dict]:
        """One dict per sample of a rollout step (trajectories.jsonl's rows; also the W&B samples table's); ``extra``:
        per sample, the columns judgers logged (``log_extra``), after the row's own fields (:func:`with_extra`)."""
        k = self.k
        return with_extra([{
            "step": step, "rank": self.ranks.rank, "group": e.group, "data_source": records[i // k].data_source,
            "prompt": self.prompt_text(records[i // k], e), "completion": text,
            "ground_truth": records[i // k].columns.get("ground_truth"),
            "reward": e.reward, "advantage": e.advantage, "finish_reason": e.finish_reason,
            "num_tokens": len(e.completion_ids), "policy_version": e.policy_version,
            **({"token_versions": e.token_versions} if e.token_versions is not None else {}),
            **({"judgers_failed": e.info["judgers_failed"]} if e.info.get("judgers_failed") else {}),
        } for i, (text, e) in enumerate(zip(texts, experiences))], extra)

    def prompt_text(self, record: PromptRecord, experience: Experience) -> str:
        """The prompt a sample was generated from: the record's, or the one its environment wrote (decoded)."""
        if experience.prompt_ids is record.prompt_ids or experience.prompt_ids == record.prompt_ids:
            return record.prompt_text
        return self.tokenizer.decode(experience.prompt_ids, skip_special_tokens=False)

    # -------------------------------------------------------------------------------------- evaluation
    def evaluate(self, batch: list[PromptRecord], step: int, batch_idx: int, cores: Any) -> dict[str, Any]:
        """Generate ``data.eval.k`` completions per prompt with the evaluation sampling settings and judge them.

        Sampling runs on a forked RNG seeded from (``seed``, ``step``, ``batch_idx``) (see
        :func:`rlflow.training.evaluation.isolated_rng`), so it never moves the training random stream; ``cores``
        is the context the generation runs in (the pipeline's lent cores). Returns per prompt lists of ``k``
        rewards, correctness flags, lengths, judger-failure flags and stated answers (None where no judger states
        them), the prompts' data sources, and ``samples``: one plain row per sample (``eval_trajectories.jsonl``'s,
        with ``trained_steps`` = ``step``, the rollout steps trained so far).
        """
        plan = self.evaluation
        k = plan.k
        seed = eval_seed(plan.seed, step, batch_idx)
        with isolated_rng(seed), isolated_draws(self.backend, seed), cores:  # a seeded engine's draws too
            groups = self.backend_for(batch).generate(self.prompt_inputs(batch), plan.sampling, n=k)
        completions = [c for group in groups for c in group]
        result, texts = self.judges.judge(batch, completions, k, self.run_state(step))
        notes = JudgerNotes()  # log_extra columns go to the rows; log_metric values are not logged in evaluation
        notes.add(completions, result)
        per_prompt = [result.rewards[i * k: (i + 1) * k] for i in range(len(batch))]
        correct = [[r >= plan.pass_threshold for r in group] for group in per_prompt]
        answers = self.judges.answers(batch, texts, k)  # for maj@k, and the rows' ``answer``
        samples = with_extra([{
            "trained_steps": step, "rank": self.ranks.rank, "batch": batch_idx,
            "data_source": batch[i // k].data_source, "prompt": batch[i // k].prompt_text, "sample": i % k,
            "completion": text, "ground_truth": batch[i // k].columns.get("ground_truth"), "reward": result.rewards[i],
            "correct": correct[i // k][i % k], "finish_reason": c.finish_reason, "num_tokens": c.num_sampled,
            **({"answer": answers[i // k][i % k]} if answers[i // k] is not None else {}),
            **({"judgers_failed": list(result.failed_at(i))} if result.failed_at(i) else {}),
        } for i, (text, c) in enumerate(zip(texts, completions))], notes.rows(completions))
        return {
            "answers": answers,
            "rewards": per_prompt,
            "correct": correct,
            "lengths": [[c.num_sampled for c in g] for g in groups],
            "failed": [[bool(result.failed_at(i * k + j)) for j in range(k)] for i in range(len(batch))],
            "data_sources": [r.data_source for r in batch],
            "samples": samples,
        }


def with_extra(rows: list[dict[str, Any]], extra: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``rows`` with, after their own fields, the columns judgers logged for each (``log_extra``); a column named
    like a field of the row is left out (the row's own value stays)."""
    for row, logged in zip(rows, extra or []):
        for column, value in logged.items():
            row.setdefault(column, value)
    return rows
