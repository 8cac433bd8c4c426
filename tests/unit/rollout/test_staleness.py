"""The staleness gate (rlflow.rollout.staleness), the pipeline's settings and its read-ahead of the prompt sampler."""

from __future__ import annotations

import pytest

from rlflow.config_error import ConfigError
from rlflow.data.mix import MixBatchSampler
from rlflow.data.sampler import PromptBatchSampler
from rlflow.data.settings import PipelineSettings
from rlflow.rollout.pipeline import make_pipeline, peek_next_batch
from rlflow.rollout.staleness import StalenessGate


def test_gate_admits_exactly_the_groups_within_the_bound_and_measures_them():
    gate = StalenessGate(max_staleness=2)
    result = gate.check([7, 6, 5, 4, 7], trained_version=7)  # staleness 0, 1, 2, 3, 0
    assert result.stale == [3]
    assert result.metrics["sampling/staleness/mean"] == pytest.approx((0 + 1 + 2 + 0) / 4)
    assert result.metrics["sampling/staleness/max"] == 2.0
    # on-policy: only the current version passes
    assert StalenessGate(0).check([3, 2], trained_version=3).stale == [1]


def test_gate_rejects_a_stamp_from_the_future():
    with pytest.raises(RuntimeError, match="newer than the weights"):
        StalenessGate(1).check([4], trained_version=3)


def test_gate_counters_survive_a_checkpoint():
    gate = StalenessGate(1, "drop")
    gate.dropped_groups, gate.regenerated_groups = 3, 4
    other = StalenessGate(1, "drop")
    other.load_state_dict(gate.state_dict())
    assert (other.dropped_groups, other.regenerated_groups) == (3, 4)
    assert other.check([1], 1).metrics["sampling/staleness/dropped_groups"] == 3.0


@pytest.mark.parametrize("value", [-1, 1.5, True, "1"])
def test_bad_max_staleness_is_a_config_error(value):
    with pytest.raises(ConfigError, match="data.pipeline.max_staleness"):
        StalenessGate(value)


def test_pipeline_settings_are_checked():
    assert make_pipeline(PipelineSettings(), seed=0) is None  # today's loop: no pipeline, no generator process
    with pytest.raises(ConfigError, match="data.pipeline.stale_policy"):
        PipelineSettings(max_staleness=1, stale_policy="ignore")
    with pytest.raises(ConfigError, match="data.pipeline.generator_threads"):
        PipelineSettings(max_staleness=1, generator_threads=0)
    with pytest.raises(ConfigError, match="data.filtering.dynamic_sampling"):
        make_pipeline(PipelineSettings(max_staleness=1), seed=0, dynamic_sampling=True)
    with pytest.raises(ConfigError, match="multi-turn .*data.pipeline.max_staleness=0"):
        make_pipeline(PipelineSettings(max_staleness=1), seed=0, multiturn=True)
    pipeline = make_pipeline(PipelineSettings(max_staleness=2, stale_policy="drop", generator_threads=2), seed=3)
    assert (pipeline.gate.max_staleness, pipeline.gate.policy, pipeline.threads, pipeline.seed) == (2, "drop", 2, 3)


def _replay(sampler, epochs: int) -> tuple[list[list[int]], list[list[int]]]:
    """Iterate ``sampler`` as Lightning does (set_epoch, one batch consumed per step); peek after each step."""
    drawn, peeked = [], []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in sampler:
            sampler.mark_consumed()
            drawn.append(list(batch))
            peeked.append(peek_next_batch(sampler))
    return drawn, peeked


@pytest.mark.parametrize("make", [
    lambda: PromptBatchSampler(10, 4, seed=3),  # 2 batches an epoch: peeks cross epoch boundaries
    lambda: MixBatchSampler([5, 7], [1.0, 2.0], batch_size=4, seed=1),
])
def test_peek_gives_the_batch_the_sampler_yields_next(make):
    drawn, peeked = _replay(make(), epochs=3)
    assert len(drawn) >= 6
    assert peeked[:-1] == drawn[1:]
    assert len({tuple(b) for b in drawn}) > 1  # batches differ, so the comparison is not trivial


def test_peek_after_a_resume_continues_from_the_checkpointed_position():
    sampler = PromptBatchSampler(12, 4, seed=5)
    sampler.set_epoch(0)
    it = iter(sampler)
    next(it)
    sampler.mark_consumed()
    resumed = PromptBatchSampler(12, 4, seed=5)
    resumed.load_state_dict(sampler.state_dict())
    assert peek_next_batch(resumed) == next(it) == next(iter(resumed))
