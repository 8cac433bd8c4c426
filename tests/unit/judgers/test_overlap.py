"""Judging overlapped with generation (rlflow.judgers.overlap): judging starts before generation ends (measured on the
``engine`` backend), results equal judging the whole batch at once, failures are counted and nothing hangs."""

from __future__ import annotations

import random
import statistics
import threading
import time

import pytest
import torch

from rlflow.data.datamodule import RolloutDataModule
from rlflow.judgers.overlap import OverlappedJudging, generate_and_judge
from rlflow.judgers.runner import JudgerRunner, JudgerStats, judge_metrics
from rlflow.rollout.base import Completion, RolloutBackend

K = 4


def make_dm(tiny_model, tiny_data, judgers, **kw):
    dm = RolloutDataModule(
        train_data_path=str(tiny_data / "train.jsonl"),
        tokenizer_path=str(tiny_model),
        prompt_repeat_k=K,
        global_batch_size=8,
        **kw,
        sampling={"max_tokens": 8},
    )
    dm.setup("fit")
    dm.judges.default = JudgerRunner(judgers, timeout=10.0, isolation="thread")  # judgers record calls here
    return dm


def judge_whole(dm, records, completions):
    """The reference: the whole batch judged at once by the judge panel: (rewards, metrics, texts)."""
    result, texts = dm.judges.judge(records, completions, K)
    return result.rewards, result.metrics, texts


def run(dm, records):
    """``generate_and_judge`` the way the datamodule calls it."""
    return generate_and_judge(dm.backend, dm.judges.judge, records, dm.sampling, K, dm.judging.overlap)


def half_none(completions, **kwargs):
    """Scores odd-length texts by their length, leaves the others unscored (None)."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]  # TRL's plain or chat layout
    return [float(len(t)) if len(t) % 2 else None for t in texts]


def answered(completions, **kwargs):
    """1.0 for a ``####`` answer, None (not applicable) otherwise."""
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [1.0 if "####" in t else None for t in texts]


class ShuffledStream(RolloutBackend):
    """A streaming backend with pre-made completions, finishing groups in a shuffled order (a pause after each)."""

    streams = True

    def __init__(self, groups, seed=0, pause=0.01):
        self.groups, self.pause = groups, pause
        self.order = list(range(len(groups)))
        random.Random(seed).shuffle(self.order)
        self.generate_calls = self.stream_calls = 0

    def stream(self, prompts, params, n=1, progress=None):
        self.stream_calls += 1
        assert len(prompts) == len(self.groups) and n == K
        for i in self.order:
            time.sleep(self.pause)
            yield i, self.groups[i]

    def generate(self, prompts, params, n=1, progress=None):
        self.generate_calls += 1
        return self.groups


def premade(dm, records, tokenizer, seed=0):
    """K completions per record: the right ``#### answer``, a wrong one, and free text of varying length."""
    rng = random.Random(seed)
    groups = []
    for r in records:
        texts = [f"#### {r.columns['ground_truth']}", "#### 999", "x" * rng.randint(1, 6), "1+1=" * rng.randint(1, 3)]
        groups.append([Completion(tokenizer.encode(t, add_special_tokens=False), [-0.1], "stop") for t in texts])
    return groups


def test_judge_metrics_against_plain_statistics():
    per_judger = {"a": [1.0, None, 3.0, 6.0], "b": [None, None, 2.0, None], "c": [None] * 4}
    m = judge_metrics(per_judger, {"a": JudgerStats(4, 1), "b": JudgerStats(4, 1)})
    assert m["judger/unscored"] == 1.0 and m["judger/failures"] == 2.0  # sample 1: no judger scored it
    assert m["rewards/a/mean"] == pytest.approx(statistics.mean([1, 3, 6]))
    assert m["rewards/a/std"] == pytest.approx(statistics.stdev([1, 3, 6]))
    assert m["rewards/b/mean"] == 2.0 and m["rewards/b/std"] == 0.0
    assert "rewards/c/mean" not in m


def test_shuffled_stream_equals_whole_batch_judging(tiny_model, tiny_data, tokenizer, progress_recorder):
    dm = make_dm(tiny_model, tiny_data, {"*": ["gsm8k", half_none]})
    dm.judges.default = JudgerRunner({"*": [answered, half_none]}, reward_weights={"answered": 2.0})
    records = dm.train_records[:8]
    groups = premade(dm, records, tokenizer)
    dm.backend, dm.rollout_progress = ShuffledStream(groups), progress_recorder
    overlap = OverlappedJudging(dm.judges.judge, K)
    out_groups, result, texts = overlap.run(
        dm.backend.stream([r.prompt_ids for r in records], None, K), records, dm.rollout_progress
    )
    rewards, metrics = result.rewards, result.metrics
    assert len(overlap.jobs) > 1  # judged in several chunks, not once at the end
    assert all(sorted(chunk) == chunk for chunk, _ in overlap.jobs)
    assert out_groups == groups  # prompt order, not finishing order
    flat = [c for g in groups for c in g]
    ref_rewards, ref_metrics, ref_texts = judge_whole(dm, records, flat)
    assert rewards == ref_rewards and texts == ref_texts and metrics == ref_metrics
    assert len(set(rewards)) > 2 and 0 < metrics["judger/unscored"] < len(flat)  # the comparison is not vacuous
    # the listener saw the whole batch, group by group in finishing order
    order = dm.backend.order
    assert dm.rollout_progress.calls == [
        ("start", 8 * K),
        *[("update", K, sum(len(c.token_ids) for c in groups[i])) for i in order],
        ("close",),
    ]


def test_make_experience_paths_agree(tiny_model, tiny_data, tokenizer):
    """The hook in make_experience: overlapped (stream) and plain (generate) give the same experience and metrics."""
    results = []
    for overlap in (True, False):
        dm = make_dm(tiny_model, tiny_data, {"*": ["gsm8k", half_none]}, judging={"overlap": overlap})
        records = dm.train_records[:8]
        dm.backend = ShuffledStream(premade(dm, records, tokenizer), seed=3, pause=0.0)
        dm.bind(None)  # the experience maker, around the pre-made backend
        metrics = dm.make_experience(records, policy_version=0, step=0).metrics
        assert (dm.backend.stream_calls, dm.backend.generate_calls) == ((1, 0) if overlap else (0, 1))
        drop = {"rollout/time", "rollout/tokens_per_s"}
        results.append(
            (
                {k: v for k, v in metrics.items() if k not in drop},
                [(e.reward, e.advantage, e.completion_ids) for e in dm.buffer.items],
            )
        )
    assert results[0] == results[1]


def test_backend_without_stream_takes_plain_path(tiny_model, tiny_data, tokenizer):
    dm = make_dm(tiny_model, tiny_data, {"*": "gsm8k"})
    records = dm.train_records[:2]
    groups = premade(dm, records, tokenizer)

    class Plain(RolloutBackend):
        def generate(self, prompts, params, n=1, progress=None):
            return groups

    dm.backend = Plain()
    out, result, texts, _ = run(dm, records)
    rewards = result.rewards
    assert out == groups and rewards == judge_whole(dm, records, [c for g in groups for c in g])[0]
    assert rewards[:2] == [1.0, 0.0]  # right answer, wrong answer


def test_raising_judger_counted_as_failures_and_no_hang(tiny_model, tiny_data, tokenizer):
    def broken(completions, **kwargs):
        raise RuntimeError("judge service down")

    dm = make_dm(tiny_model, tiny_data, {"*": ["gsm8k", broken]})
    records = dm.train_records[:6]
    groups = premade(dm, records, tokenizer)
    dm.backend = ShuffledStream(groups)
    t0 = time.perf_counter()
    _, result, _, _ = run(dm, records)
    rewards, metrics = result.rewards, result.metrics
    assert time.perf_counter() - t0 < 5
    ref_rewards, ref_metrics, _ = judge_whole(dm, records, [c for g in groups for c in g])
    assert metrics["judger/failures"] == 6 * K == ref_metrics["judger/failures"]  # every sample lost broken's reward
    assert rewards == ref_rewards and metrics == ref_metrics
    assert result.failed == [("broken",)] * (6 * K)  # each sample marked, through the chunks' merge


def test_contract_violation_in_worker_raises(tiny_model, tiny_data, tokenizer):
    def wrong_length(completions, **kwargs):
        return [1.0]

    dm = make_dm(tiny_model, tiny_data, {"*": wrong_length})
    records = dm.train_records[:3]
    dm.backend = ShuffledStream(premade(dm, records, tokenizer))
    with pytest.raises(ValueError, match="returned 1 rewards"):
        run(dm, records)
    for worker in [t for t in threading.enumerate() if t.name.startswith("rlflow-overlap-judge")]:
        worker.join(timeout=2.0)  # the worker is let go, not waited for: it must end on its own
        assert not worker.is_alive()


class TimedEngine(RolloutBackend):
    """Wraps the engine backend, recording when each group finished generating."""

    streams = True

    def __init__(self, engine):
        self.engine, self.finished = engine, []

    def bind(self, model, tokenizer):
        self.engine.bind(model, tokenizer)

    def stream(self, prompts, params, n=1, progress=None):
        for item in self.engine.stream(prompts, params, n):
            self.finished.append(time.perf_counter())
            yield item


def test_judging_starts_before_generation_ends_on_engine(tiny_model, tiny_data):
    from transformers import AutoModelForCausalLM

    from rlflow.rollout.engine import EngineRollout

    starts = []

    def timed(completions, **kwargs):
        starts.append(time.perf_counter())
        return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]

    dm = make_dm(tiny_model, tiny_data, {"*": timed})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    dm.backend = TimedEngine(EngineRollout(max_batch_size=K, prefill_batch_size=1, seed=0))  # one group at a time
    dm.bind(model)
    records = dm.train_records[:4]
    groups, result, texts, gen_time = run(dm, records)
    rewards = result.rewards
    assert len(dm.backend.finished) == 4 and len(groups) == 4 and len(rewards) == 4 * K
    assert min(starts) < max(dm.backend.finished)  # measured: a judge call began while a group was still generating
    assert rewards == [float(len(t)) for t in texts]
    assert gen_time > 0
