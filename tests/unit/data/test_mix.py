"""The weighted mix sampler: per-step shares against the weights, determinism, per-source epochs, resume."""


from __future__ import annotations

import bisect
import itertools
import math

import pytest

from rlflow.data.mix import MixBatchSampler


def per_source(batch, sizes):
    """Count a batch's indices per source with plain offsets (independent of the sampler's own bookkeeping)."""
    starts = list(itertools.accumulate([0] + list(sizes[:-1])))
    counts = [0] * len(sizes)
    for index in batch:
        counts[bisect.bisect_right(starts, index) - 1] += 1
    return counts


@pytest.mark.parametrize(
    "sizes, weights, batch_size",
    [([50, 30, 20], [3.0, 1.0, 0.5], 16), ([7, 1000], [1.0, 1.0], 5), ([40, 40, 40, 40], [0.1, 0.2, 0.3, 0.4], 7)],
)
def test_every_step_gives_each_source_its_share(sizes, weights, batch_size):
    sampler = MixBatchSampler(sizes, weights, batch_size, seed=3)
    total_w = sum(weights)
    quota = [batch_size * w / total_w for w in weights]
    running = [0] * len(sizes)
    steps = 2000
    for step in range(1, steps + 1):
        batch = sampler.next_batch()
        assert len(batch) == batch_size
        counts = per_source(batch, sizes)
        for i, c in enumerate(counts):
            assert c in (math.floor(quota[i]), math.ceil(quota[i])), (step, i, c, quota[i])
            running[i] += c
            assert abs(running[i] - step * quota[i]) < 1.0 + 1e-9  # never more than one prompt off the ideal
    for i, w in enumerate(weights):  # and the long-run share is the weight share
        assert running[i] / (steps * batch_size) == pytest.approx(w / total_w, abs=1 / (steps * batch_size))


def test_hand_computed_schedule_for_two_to_one_weights():
    # quotas 2 and 1 of a batch of 3: exactly 2 + 1 every step; quotas 1.5/1.5 of 3: alternating 2/1 and 1/2
    s = MixBatchSampler([10, 10], [2, 1], 3)
    assert [per_source(s.next_batch(), [10, 10]) for _ in range(4)] == [[2, 1]] * 4
    s = MixBatchSampler([10, 10], [1, 1], 3)
    assert [per_source(s.next_batch(), [10, 10]) for _ in range(4)] == [[2, 1], [1, 2], [2, 1], [1, 2]]


def test_deterministic_and_seeded():
    a = MixBatchSampler([20, 9], [1, 2], 6, seed=0)
    b = MixBatchSampler([20, 9], [1, 2], 6, seed=0)
    c = MixBatchSampler([20, 9], [1, 2], 6, seed=1)
    run_a = [a.next_batch() for _ in range(30)]
    assert run_a == [b.next_batch() for _ in range(30)]
    assert run_a != [c.next_batch() for _ in range(30)]


def test_each_source_cycles_through_its_own_epochs():
    sizes = [5, 12]
    s = MixBatchSampler(sizes, [1, 1], 4, seed=7)
    seen = [0] * sum(sizes)
    for _ in range(30):  # 60 prompts per source: 12 epochs of the small one, 5 of the large one
        for index in s.next_batch():
            seen[index] += 1
        # epoch-aware: within a source, no prompt is drawn a second time before every other one was drawn once
        assert max(seen[:5]) - min(seen[:5]) <= 1 and max(seen[5:]) - min(seen[5:]) <= 1
    assert seen == [12] * 5 + [5] * 12
    assert s.source_epochs() == {"source0": 12.0, "source1": 5.0}
    assert s.permutation(0, 0).tolist() != s.permutation(0, 1).tolist()  # reshuffled between epochs


def test_resume_continues_the_same_stream():
    straight = MixBatchSampler([13, 8, 21], [1, 1, 2], 8, seed=5)
    expected = [straight.next_batch() for _ in range(20)]
    first = MixBatchSampler([13, 8, 21], [1, 1, 2], 8, seed=5)
    head = [first.next_batch() for _ in range(9)]
    state = first.state_dict()
    resumed = MixBatchSampler([13, 8, 21], [1, 1, 2], 8, seed=5)
    resumed.load_state_dict(state)
    assert head + [resumed.next_batch() for _ in range(11)] == expected


def test_state_follows_consumed_batches_not_prefetched_ones():
    s = MixBatchSampler([13, 8], [1, 3], 4, seed=2)
    it = iter(s)
    batches = [next(it) for _ in range(4)]  # the loader fetched 4 batches ...
    for _ in range(3):
        s.mark_consumed()  # ... but only 3 were trained on when the checkpoint was written
    state = s.state_dict()
    assert state["step"] == 3
    resumed = MixBatchSampler([13, 8], [1, 3], 4, seed=2)
    resumed.load_state_dict(state)
    assert next(iter(resumed)) == batches[3]
    resumed.mark_consumed()  # consumption counts on from the restored position
    assert resumed.state_dict()["step"] == 4
    s._history.clear()  # further back than the kept history: replayed from the start, same answer
    assert s.state_dict()["drawn"] == state["drawn"]


def test_iteration_length_and_bad_arguments():
    s = MixBatchSampler([10, 7], [1, 1], 4)
    assert len(s) == 4 and len(list(iter(s))) == 4 and s.step == 4
    with pytest.raises(ValueError, match="weight must be a positive number"):
        MixBatchSampler([3, 3], [1, 0], 2, names=["a", "b"])
    with pytest.raises(ValueError, match="'b' has no usable prompts"):
        MixBatchSampler([3, 0], [1, 1], 2, names=["a", "b"])
    with pytest.raises(ValueError, match="one weight per source"):
        MixBatchSampler([3, 3], [1], 2)
    other = MixBatchSampler([3, 4], [1, 1], 2)
    with pytest.raises(ValueError, match="resume with the same data"):
        other.load_state_dict(s.state_dict())

