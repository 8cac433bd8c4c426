"""Counter-based sampling draws (rlflow.rollout.draws): splitmix64 against its published test vector, uniformity and
independence of the draws, token frequencies against a plain softmax, and the engine property they exist for: a
row samples the same tokens alone, inside a bigger batch and admitted later, and a seeded engine's draws continue
exactly from a saved state."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlflow.rollout.base import SamplingParams
from rlflow.rollout.draws import RowDraws, stream_key, uniforms
from rlflow.rollout.engine import EngineRollout
from rlflow.rollout.requests import DecodeRequest, ListSource
from rlflow.rollout.sampling import sample_tokens
from tests.helpers.multiturn_helpers import tiny_model

# splitmix64 seeded with 1234567: its first five outputs (Rosetta Code, "Pseudo-random numbers/Splitmix64")
SPLITMIX_1234567 = [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431,
                    16408922859458223821]


def test_uniforms_are_splitmix64_outputs():
    u = uniforms(np.full(5, 1234567, dtype=np.uint64), np.arange(5, dtype=np.uint64))
    assert [int(x * 2.0 ** 53) for x in u] == [v >> 11 for v in SPLITMIX_1234567]
    # the engine's per-row streams: the same outputs from a row's starting counter on, one per step
    draws = RowDraws()
    draws.add([1234567, 1234567], [0, 2])
    steps = [draws.draw(torch.device("cpu")).tolist() for _ in range(3)]
    assert [s[0] for s in steps] == u[:3].tolist() and [s[1] for s in steps] == u[2:5].tolist()


def ks_statistic(u: np.ndarray) -> float:
    """Kolmogorov-Smirnov distance of a sample from U(0, 1), worked out directly."""
    u = np.sort(u)
    n = len(u)
    return float(max((np.arange(1, n + 1) / n - u).max(), (u - np.arange(n) / n).max()))


def test_draws_are_uniform_and_independent_across_rows_and_steps():
    n = 20000
    across_rows = uniforms(np.array([stream_key(7, i) for i in range(n)], dtype=np.uint64), np.zeros(n, np.uint64))
    along_a_row = uniforms(np.full(n, stream_key(7, 0), dtype=np.uint64), np.arange(n, dtype=np.uint64))
    crit = 1.95 / math.sqrt(n)  # KS at alpha = 0.001
    for u in (across_rows, along_a_row):
        assert 0.0 <= u.min() and u.max() < 1.0
        assert ks_statistic(u) < crit
    # pairs (row i's draw, row i+1's draw) and (step t, step t+1) fill a 10 x 10 grid evenly: chi-square, 99 dof
    for u in (across_rows, along_a_row):
        counts = np.histogram2d(u[:-1], u[1:], bins=10, range=[[0, 1], [0, 1]])[0]
        expected = (n - 1) / 100
        chi2 = float(((counts - expected) ** 2 / expected).sum())
        assert chi2 < 160  # the 0.9999 quantile of chi-square(99) is about 157


def plain_probs(logits: list[float], temperature: float, top_k: int = 0) -> list[float]:
    """softmax(logits / temperature) kept to the top_k best tokens and renormalised, in plain Python."""
    scaled = [x / temperature for x in logits]
    if top_k:
        kth = sorted(scaled, reverse=True)[top_k - 1]
        scaled = [x if x >= kth else -math.inf for x in scaled]
    m = max(scaled)
    e = [math.exp(x - m) for x in scaled]
    return [x / sum(e) for x in e]


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 3)])
def test_token_frequencies_match_the_softmax(temperature, top_k):
    logits = [1.5, 0.2, -0.4, 0.9, -2.0, 0.0]
    rows = 30000
    draws = RowDraws()
    draws.add([stream_key(11, i) for i in range(rows)], [5] * rows)
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=4)
    tokens, _ = sample_tokens(torch.tensor([logits]).repeat(rows, 1), params, uniform=draws.draw(torch.device("cpu")))
    counts = np.bincount(tokens.numpy(), minlength=len(logits))
    probs = plain_probs(logits, temperature, top_k)
    support = [i for i, p in enumerate(probs) if p > 0]
    assert all(counts[i] == 0 for i in range(len(logits)) if i not in support)
    chi2 = sum((counts[i] - rows * probs[i]) ** 2 / (rows * probs[i]) for i in support)
    assert chi2 < 25  # chi-square with at most 5 dof: 0.9999 quantile about 25.7


@pytest.fixture(scope="module")
def model():
    return tiny_model(61, seed=4)


class NoTokenizer:
    pad_token_id = eos_token_id = 0


def engine_for(model, **kwargs) -> EngineRollout:
    engine = EngineRollout(**kwargs)
    engine.bind(model, NoTokenizer())
    return engine


class Trickle:
    """A request source that hands over one more request every ``every`` polls (the engine admits them while
    the earlier ones decode)."""

    def __init__(self, requests, every: int = 3):
        self.requests, self.every, self.polls = list(requests), every, 0

    def poll(self, wait):
        if not self.requests:
            return None
        self.polls += 1
        return [self.requests.pop(0)] if wait or self.polls % self.every == 0 else []


@pytest.mark.parametrize("fused", [True, False])  # the fused decoder, and the model's forward with LaneStates
def test_a_row_samples_the_same_alone_in_a_batch_and_admitted_later(model, fused, one_thread):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 61, (int(k),), generator=g).tolist() for k in (5, 9, 7, 12, 6)]
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=14)
    target = DecodeRequest(prompts[2], [stream_key(99, 2)], start=3, tag="target")
    engine = engine_for(model, seed=0, min_shared_prefix=0, fused=fused)
    alone = {r.tag: g for r, g in engine.serve(ListSource([target]), params)}["target"][0]
    others = [DecodeRequest(p, [stream_key(99, i, s) for s in range(3)], tag=i) for i, p in enumerate(prompts)]
    together = {r.tag: g for r, g in engine.serve(ListSource([others[0], target, *others[1:]]), params)}
    later = {r.tag: g for r, g in engine_for(model, seed=5, max_batch_size=7, prefill_batch_size=1, fused=fused).serve(
        Trickle([*others[:3], target, *others[3:]]), params)}
    assert len(alone.token_ids) >= 2
    for run in (together, later):
        got = run["target"][0]
        assert got.token_ids == alone.token_ids and got.finish_reason == alone.finish_reason
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    # the other requests (groups of three, in another lane) came out the same in both batches as well
    for i in range(len(prompts)):
        assert [c.token_ids for c in together[i]] == [c.token_ids for c in later[i]]


def test_a_seeded_engine_continues_its_draws_from_a_saved_state(model, one_thread):
    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    params = SamplingParams(temperature=1.0, max_tokens=10)
    straight = engine_for(model, seed=21)
    first = straight.generate(prompts, params, n=2)
    state = straight.rng_state()
    second = straight.generate(prompts, params, n=2)
    assert [c.token_ids for g in second for c in g] != [c.token_ids for g in first for c in g]  # a new call key
    resumed = engine_for(model, seed=21)
    resumed.load_rng_state(state)
    again = resumed.generate(prompts, params, n=2)
    assert [c.token_ids for g in again for c in g] == [c.token_ids for g in second for c in g]
    other_seed = engine_for(model, seed=22)
    other_seed.load_rng_state(state)  # a changed seed starts afresh rather than continuing the old seed's count
    assert other_seed.rng_state() == {"seed": 22, "calls": 0}


def test_an_unseeded_engine_draws_its_call_key_from_torch(model, one_thread):
    prompts = [[3, 4, 5, 6]]
    params = SamplingParams(temperature=1.0, max_tokens=10)
    engine = engine_for(model)
    torch.manual_seed(8)
    a = engine.generate(prompts, params, n=3)
    b = engine.generate(prompts, params, n=3)
    torch.manual_seed(8)
    assert engine.generate(prompts, params, n=3) == a and engine.generate(prompts, params, n=3) == b
    assert a != b


def test_evaluating_does_not_move_a_seeded_engines_draws(model, one_thread):
    from rlflow.rollout.draws import isolated_draws

    prompts = [[3, 4, 5, 6]]
    params = SamplingParams(temperature=1.0, max_tokens=10)
    engine = engine_for(model, seed=4)
    engine.generate(prompts, params, n=2)
    before = engine.rng_state()
    with isolated_draws(engine, 77):
        inside = engine.generate(prompts, params, n=2)
        assert engine.rng_state() == {"seed": 77, "calls": 1}
    assert engine.rng_state() == before
    with isolated_draws(engine, 77):  # the same evaluation seed: the same samples
        assert engine.generate(prompts, params, n=2) == inside
