"""Judging overlapped with generation: groups are judged as soon as they finish, while the rest still generates.

A backend whose :attr:`~rlflow.rollout.base.RolloutBackend.streams` is true (the ``engine`` backend) yields each
prompt's group from ``stream(prompts, params, n)`` when its last completion ends. :class:`OverlappedJudging`
hands the finished groups to one background worker thread, in chunks: whatever has finished since the last
submission goes as soon as the worker is idle (the chunk size
adapts to how fast judging keeps up), and the rest after the stream ends. The caller gets completions in prompt
order and the rewards, texts and judge metrics the whole batch judged at once would give: per-sample rewards do
not depend on the batch, and ``rewards/<name>/mean|std`` and ``judger/unscored`` are recomputed over the whole
batch from the per-sample per-judger values (:func:`rlflow.judgers.runner.merge_results`); ``judger/failures``
counts, each judger's samples and failures, ``log_extra`` columns and ``log_metric`` values add up. A backend
that does not stream (``hf``), or ``data.judging.overlap=false``, takes the plain path: generate everything, then
judge once.

Simplifications: one worker, so chunks are judged one after another (judgers inside a chunk still run
concurrently, see :class:`~rlflow.judgers.runner.JudgerRunner`); ``data.judging.timeout`` applies per chunk; a
judger whose reward depends on the other samples of its call (none of the built-in ones) would see chunks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from rlflow.judgers.runner import JudgeResult, merge_results

# (records, completions, k) -> (JudgeResult, texts)
Judge = Callable[[list[Any], list[Any], int], tuple[Any, list[str]]]


class OverlappedJudging:
    """Consumes a stream of finished groups and judges them on a background thread while generation goes on.

    Args:
        judge: ``judge(records, completions, k) -> (JudgeResult, texts)`` for a chunk of prompts (the judge panel's
            :meth:`~rlflow.judgers.panel.JudgePanel.judge`); called on the worker thread.
        k: Completions per prompt.
    """

    def __init__(self, judge: Judge, k: int) -> None:
        self.judge = judge
        self.k = k
        self.jobs: list[tuple[list[int], Future]] = []  # (prompt indices of the chunk, its judging)
        self.submitted_at: list[float] = []  # perf_counter() of each chunk's submission
        self.generation_end = 0.0  # perf_counter() when the stream ended

    def run(self, stream: Iterable[tuple[int, list[Any]]], records: list[Any], listener: Any = None,
            ) -> tuple[list[list[Any]], JudgeResult, list[str]]:
        """Generate and judge: ``(groups in prompt order, the whole batch's JudgeResult, texts)``, the result's
        lists and the texts flattened in prompt order (``k`` per prompt). ``listener`` gets ``start(total)``,
        ``update(completions, tokens)`` per finished group and ``close()`` when generation ends."""
        groups: list[list[Any] | None] = [None] * len(records)
        pending: list[int] = []
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlflow-overlap-judge")
        ok = False
        try:
            if listener is not None:
                listener.start(len(records) * self.k)
            try:
                for index, group in stream:
                    if groups[index] is not None or len(group) != self.k:
                        raise RuntimeError(f"the rollout stream gave prompt {index} {len(group)} completions "
                                           f"(again: {groups[index] is not None}); expected {self.k} once")
                    groups[index] = group
                    pending.append(index)
                    if listener is not None:
                        listener.update(len(group), sum(len(c.token_ids) for c in group))
                    if self.idle():
                        self.submit(pool, pending, records, groups)
                        pending = []
            finally:
                self.generation_end = time.perf_counter()
                if listener is not None:
                    listener.close()
            missing = [i for i, g in enumerate(groups) if g is None]
            if missing:
                raise RuntimeError(f"the rollout stream ended without the groups of prompt(s) {missing[:10]}")
            if pending:
                self.submit(pool, pending, records, groups)
            result, texts = self.collect(len(records))
            ok = True
            return groups, result, texts  # type: ignore[return-value]
        finally:  # on an error, do not wait for judging nobody will read
            pool.shutdown(wait=ok, cancel_futures=not ok)

    def idle(self) -> bool:
        """Whether the worker has finished every chunk so far (a failed chunk raises here, not after the stream)."""
        if not self.jobs:
            return True
        last = self.jobs[-1][1]
        if last.done() and last.exception() is not None:
            raise last.exception()  # a judger broke its contract: an error, as in the plain path
        return last.done()

    def submit(self, pool: ThreadPoolExecutor, indices: list[int], records: list[Any], groups: list[Any]) -> None:
        chunk = sorted(indices)
        completions = [c for i in chunk for c in groups[i]]
        self.submitted_at.append(time.perf_counter())
        self.jobs.append((chunk, pool.submit(self.judge, [records[i] for i in chunk], completions, self.k)))

    def collect(self, num_prompts: int) -> tuple[JudgeResult, list[str]]:
        """Wait for every chunk; put rewards, failures, texts and per-judger values back in prompt order; recompute
        the metrics."""
        k, total = self.k, num_prompts * self.k
        texts: list[str] = [""] * total
        parts = []
        for chunk, job in self.jobs:
            result, chunk_texts = job.result()
            slots = [i * k + j for i in chunk for j in range(k)]
            for slot, text in zip(slots, chunk_texts):
                texts[slot] = text
            parts.append((slots, result))
        return merge_results(total, parts), texts


def generate_and_judge(backend: Any, judge: Judge, records: list[Any], params: Any, k: int, overlap: bool = True,
                       listener: Any = None, prompts: list[list[int]] | None = None,
                       ) -> tuple[list[list[Any]], JudgeResult, list[str], float]:
    """One rollout step's generation and judging: ``(groups, JudgeResult, texts, generation seconds)``.

    Overlapped when ``overlap`` and the backend :attr:`~rlflow.rollout.base.RolloutBackend.streams`, else
    generate everything, then judge once. ``listener`` (``start``/``update``/``close``) follows the generation.
    ``prompts``: what the backend is given for ``records`` (default: their token ids; prompts with images are
    :class:`rlflow.models.vision.ImagePrompt` s).
    """
    prompt_ids = prompts if prompts is not None else [r.prompt_ids for r in records]
    t0 = time.perf_counter()
    if overlap and backend.streams:
        overlapped = OverlappedJudging(judge, k)
        groups, result, texts = overlapped.run(backend.stream(prompt_ids, params, n=k), records, listener)
        return groups, result, texts, overlapped.generation_end - t0
    if listener is not None:
        listener.start(len(prompt_ids) * k)
    try:
        groups = backend.generate(prompt_ids, params, n=k, progress=listener.update if listener is not None else None)
    finally:
        if listener is not None:
            listener.close()
    gen_time = time.perf_counter() - t0
    result, texts = judge(records, [c for g in groups for c in g], k)
    return groups, result, texts, gen_time
