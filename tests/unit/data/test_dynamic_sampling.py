"""DAPO dynamic sampling: groups whose rewards all agree are dropped and more prompts are drawn until the batch is
full, with a cap on the rounds, a top-up when the cap is hit, and the ``sampling/*`` counts."""


from __future__ import annotations

import pytest

from rlflow.data.datamodule import RolloutDataModule
from rlflow.judgers.runner import JudgeResult
from rlflow.rollout.base import Completion, RolloutBackend

K = 2


def uniform(record) -> bool:
    """Prompts whose completions all get the same reward in these tests (no learning signal)."""
    return sum(record.prompt_ids) % 3 == 0


class FakeBackend(RolloutBackend):
    """Returns ``n`` one-token completions per prompt and records what it was asked for."""

    def __init__(self):
        self.prompts = []

    def generate(self, prompts, params, n=1, progress=None):
        self.prompts.append([tuple(p) for p in prompts])
        return [[Completion([1 + j], [-0.5], "stop") for j in range(n)] for _ in prompts]


def make_dm(tiny_model, tiny_data, **kw):
    dm = RolloutDataModule(
        train_data_path=str(tiny_data / "train.jsonl"), tokenizer_path=str(tiny_model), prompt_repeat_k=K,
        global_batch_size=4, **kw,
    )
    dm.setup("fit")
    dm.backend = FakeBackend()
    dm.bind(None)  # the experience maker, built around the backend

    def judge(records, completions, k, state=None):
        rewards = [1.0 if uniform(r) else float(j % 2) for r in records for j in range(k)]
        metrics = {"rewards/fake/mean": sum(rewards) / len(rewards)}
        return JudgeResult(rewards, {"fake": list(rewards)}, metrics), ["x"] * len(completions)

    dm.judges.judge = judge
    return dm


def first_batch(dm, n_uniform):
    u = [r for r in dm.train_records if uniform(r)]
    v = [r for r in dm.train_records if not uniform(r)]
    return u[:n_uniform] + v[: 4 - n_uniform]


def test_drops_agreeing_groups_and_refills(tiny_model, tiny_data):
    dm = make_dm(tiny_model, tiny_data, filtering={"dynamic_sampling": True, "max_rounds": 20})
    metrics = dm.make_experience(first_batch(dm, 2), policy_version=0, step=0).metrics
    kept = dm.buffer.items
    assert len(kept) == 4 * K
    for g in range(4):  # every kept group has a learning signal
        rewards = [e.reward for e in kept[g * K: (g + 1) * K]]
        assert max(rewards) > min(rewards)
    rounds = len(dm.backend.prompts)
    drawn = [p for call in dm.backend.prompts for p in call]
    by_ids = {tuple(r.prompt_ids): r for r in dm.train_records}
    assert metrics["sampling/rounds"] == rounds >= 2
    assert metrics["sampling/groups_drawn"] == len(drawn) == 4 * rounds
    assert metrics["sampling/groups_dropped"] == sum(uniform(by_ids[p]) for p in drawn)
    assert metrics["sampling/groups_padded"] == 0
    # the two informative prompts of the first batch are kept, first
    assert [tuple(e.prompt_ids) for e in kept[: 2 * K: K]] == list(dm.backend.prompts[0][2:])
    assert all(e.advantage != 0 for e in kept)


def test_round_cap_tops_up_with_dropped_groups(tiny_model, tiny_data):
    dm = make_dm(tiny_model, tiny_data, filtering={"dynamic_sampling": True, "max_rounds": 1})
    metrics = dm.make_experience(first_batch(dm, 3), policy_version=0, step=0).metrics
    assert metrics["sampling/rounds"] == 1 and metrics["sampling/groups_padded"] == 3
    assert metrics["sampling/groups_dropped"] == 3
    assert len(dm.buffer.items) == 4 * K  # every rank keeps the same batch size
    assert sum(e.advantage == 0 for e in dm.buffer.items) == 3 * K  # the top-up carries no signal


def test_extra_prompts_are_reproducible_and_off_by_default(tiny_model, tiny_data):
    a = make_dm(tiny_model, tiny_data, filtering={"dynamic_sampling": True, "max_rounds": 3})
    b = make_dm(tiny_model, tiny_data, filtering={"dynamic_sampling": True, "max_rounds": 3})
    a.make_experience(first_batch(a, 4), policy_version=0, step=5)
    b.make_experience(first_batch(b, 4), policy_version=0, step=5)
    assert a.backend.prompts == b.backend.prompts and len(a.backend.prompts) > 1
    off = make_dm(tiny_model, tiny_data)
    metrics = off.make_experience(first_batch(off, 2), policy_version=0, step=0).metrics
    assert len(off.backend.prompts) == 1 and "sampling/rounds" not in metrics
    assert len(off.buffer.items) == 4 * K


def test_ranks_run_the_same_number_of_rounds(tiny_model, tiny_data):
    """A rank whose batch is full keeps sampling while another rank's is short (collective backends need it)."""
    from types import SimpleNamespace

    import torch

    class Strategy:
        root_device = torch.device("cpu")
        calls = 0

        def reduce(self, tensor, reduce_op="mean"):
            assert reduce_op == "sum"
            self.calls += 1
            # the step's first question is whether any rank's judgers failed beyond use (no); every later one,
            # whether any rank's batch is still short: the other rank always is
            return tensor if self.calls == 1 else tensor + 1.0

    class Trainer:
        world_size, global_rank, strategy, log_dir, max_steps, max_epochs = 2, 0, Strategy(), None, 1, None
        state = SimpleNamespace(fn="validate")  # bound outside fit: no generator processes

    dm = make_dm(tiny_model, tiny_data, filtering={"dynamic_sampling": True, "max_rounds": 3})
    dm.trainer = Trainer()
    dm.bind(None)  # again, with the two ranks
    metrics = dm.make_experience(first_batch(dm, 0), policy_version=0, step=0).metrics  # this rank: full at once
    assert metrics["sampling/rounds"] == 3 and len(dm.backend.prompts) == 3
    assert len(dm.buffer.items) == 2 * K  # this rank's share of the 4 prompts, still full-size


def test_bad_round_cap_is_refused(tiny_model, tiny_data):
    with pytest.raises(ValueError, match="data.filtering.max_rounds must be >= 1, got 0"):
        RolloutDataModule(train_data_path=str(tiny_data / "train.jsonl"), filtering={"max_rounds": 0})

