"""benchmarks/pipeline_bound.py: the lent-cores bound against a brute-force search over the lent shares and
hand-worked figures, and the tool end to end on the tiny model."""

from __future__ import annotations

import itertools
import random

import pytest

from benchmarks import pipeline_bound as bound
from tests.helpers.paths import ROOT


def brute_force(gen: float, serial: float, lendable: list[tuple[float, float]], grid: int = 100) -> float:
    """min over every share of every phase (a grid of 1/grid) of the busier process's time."""
    best = float("inf")
    for shares in itertools.product(range(grid + 1), repeat=len(lendable)):
        trainer = serial + sum((1 - s / grid) * one + s / grid * every for s, (one, every) in zip(shares, lendable))
        generator = gen + sum(s / grid * every for s, (_, every) in zip(shares, lendable))
        best = min(best, max(trainer, generator))
    return best


def test_lent_step_matches_a_search_over_the_shares():
    rng = random.Random(0)
    cases = [(112.0, 23.0, [(67.0, 44.0), (100.0, 67.0)]),  # balanced: a share of the phases lent
             (300.0, 10.0, [(50.0, 30.0)]),  # the generator is the busier even with nothing lent
             (20.0, 200.0, [(50.0, 30.0), (40.0, 30.0)]),  # the trainer is the busier even with all lent
             (100.0, 20.0, [(60.0, 60.0), (90.0, 50.0)])]  # a phase that does not scale is never worth lending
    cases += [(rng.uniform(10, 300), rng.uniform(0, 200),
               [(one, one / rng.uniform(1.0, 2.0)) for one in (rng.uniform(5, 150), rng.uniform(5, 150))])
              for _ in range(20)]
    for gen, serial, lendable in cases:
        exact = bound.lent_step(gen, serial, lendable)
        searched = brute_force(gen, serial, lendable)
        step = max(every for _, every in lendable) / 100  # one grid cell moves either process by at most this
        assert exact <= searched + 1e-9 and searched - exact <= step, (gen, serial, lendable, exact, searched)


def test_bounds_by_hand():
    one = {bound.ROLLOUT: 110.0, bound.FORWARD: 70.0, bound.BACKWARD: 100.0, "whole step": 300.0}
    many = {bound.FORWARD: 45.0, bound.BACKWARD: 65.0}
    found = bound.bounds(one, many)
    # the trainer's one-thread rest: 300 - 110 - 100 = 90 (the forward's 70 in it)
    assert found["lend_cores: false"] == pytest.approx(190.0)  # max(90 + 100, 110)
    assert found["lend_cores: true"] == pytest.approx(175.0)  # max(90 + 65, 110 + 65)
    # gap 20 + 170 - 110 = 80; the backward gains 100/65 = 1.54x per held ms, the forward 70/45 = 1.56x: the
    # forward first, all of it (gap 80 - 70 = 10; generator 110 + 45 = 155), then 10/100 of the backward (+6.5)
    assert found["ideal (any share of the forward and backward lent)"] == pytest.approx(161.5)


@pytest.mark.slow
def test_tool_end_to_end(tiny_model, tiny_data, capsys):
    found = bound.main([
        "--config", str(ROOT / "configs" / "demo_cpu.yaml"), "--steps", "4", "--measure",
        f"--model.model_path={tiny_model}", f"--data.train_data_path={tiny_data / 'train.jsonl'}",
        "--data.global_batch_size=4", "--data.prompt_repeat_k=4", "--data.sampling.max_tokens=12",
    ])
    ideal = found["ideal (any share of the forward and backward lent)"]
    assert 0 < ideal <= min(found["lend_cores: false"], found["lend_cores: true"]) + 1e-9
    assert found["on-policy"] > 0 and found["measured"] > 0
    out = capsys.readouterr().out
    assert "at most" in out and "measured pipelined step" in out
