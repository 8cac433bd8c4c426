"""Asynchronous multi-turn rollouts on the engine (MultiTurn.run_async): a trajectory whose tools have answered goes
back to decoding while others wait on theirs, and with a seed the trajectories do not depend on the tools' timing.

The model is the tiny random Qwen3 over the character tokenizer; a parser that finds one call in every turn and a
quarter of the vocabulary as stop tokens make every trajectory call a tool after each short turn, whatever it
samples."""

from __future__ import annotations

import math
import random
import threading

import numpy as np
import pytest
import torch

from rlflow.data.dataset import PromptRecord
from rlflow.rollout.base import SamplingParams
from rlflow.rollout.engine import EngineRollout
from rlflow.rollout.hf import HFRollout
from rlflow.rollout.multiturn import MultiTurn
from rlflow.tools.base import ToolCall, load_tools
from rlflow.tools.parsers import ToolParser
from tests.helpers.multiturn_helpers import RecordingBackend, qwen3_char_tokenizer, tiny_model


class EveryTurnCalls(ToolParser):
    """Every turn calls ``name`` with the turn's length as ``x``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text):
        return text, [ToolCall(self.name, {"x": len(text)})]


@pytest.fixture(scope="module")
def tok():
    return qwen3_char_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    return tiny_model(len(tok), seed=1)


def records(tok, questions):
    out = []
    for q in questions:
        prompt = [{"role": "user", "content": q}]
        text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        out.append(PromptRecord(prompt, {}, "test.jsonl:1", tok.encode(text, add_special_tokens=False), text))
    return out


def params(tok, max_tokens):
    """Short turns: the end of turn and 30 of the 101 characters stop a turn."""
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, stop_token_ids=[tok.eos_token_id, *range(40, 70)])


# ------------------------------------------------------------------------------ deterministic whatever the timing
SLEEPS = random.Random()


def jitter(x: int) -> int:
    """Answers after a random pause.

    Args:
        x: Returned as is.
    """
    threading.Event().wait(SLEEPS.uniform(0.0, 0.03) if SLEEPS.random() < 0.8 else 0.15)
    return x


def rollout(tok, model, sleep_seed: int):
    SLEEPS.seed(sleep_seed)
    engine = EngineRollout(seed=3, max_batch_size=4, prefill_batch_size=2)
    engine.bind(model, tok)
    mt = MultiTurn(tok, load_tools([jitter]), parser=EveryTurnCalls("jitter"), max_turns=4)
    return mt.generate(engine, records(tok, ["Count.", "Count again."]), params(tok, 160), n=3)


def test_seeded_trajectories_do_not_depend_on_the_tools_timing(tok, model, one_thread):
    a = rollout(tok, model, sleep_seed=1)
    b = rollout(tok, model, sleep_seed=2)
    flat_a, flat_b = [c for g in a for c in g], [c for g in b for c in g]
    assert sum(c.info["turns"] >= 2 for c in flat_a) >= 4  # really multi-turn, tools answered
    assert sum(sum(c.info["tool_calls"].values()) for c in flat_a) >= 8
    assert len({tuple(c.token_ids) for c in flat_a}) == len(flat_a)  # six different trajectories
    for x, y in zip(flat_a, flat_b):
        assert x.token_ids == y.token_ids and x.mask == y.mask and x.finish_reason == y.finish_reason
        assert x.info == y.info
        # batch composition differs between the runs, which may move float rounding in the last bits only
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


# ------------------------------------------------------------------------------ a slow tool blocks nobody else
class Gate:
    """The first call waits until a third call arrives, which can only be another trajectory's call of a later
    turn (the two first-turn calls are the first two); ``wait`` bounds the wait so that a loop that would wait for
    the first call before starting the next turn fails instead of hanging."""

    def __init__(self, wait: float) -> None:
        self.wait, self.calls, self.lock = wait, 0, threading.Lock()
        self.release, self.released = threading.Event(), None

    def tool(self):
        def gate(x: int) -> int:
            """Waits for a later turn on the first call.

            Args:
                x: Returned as is.
            """
            with self.lock:
                self.calls += 1
                number = self.calls
            if number == 3:
                self.release.set()
            if number == 1:
                self.released = self.release.wait(self.wait)
                if not self.released:
                    raise RuntimeError("no later turn started while the first call waited")
            return x

        return gate


def gated_rollout(tok, model, backend_of, wait):
    gate = Gate(wait)
    engine = EngineRollout(seed=0)
    engine.bind(model, tok)
    mt = MultiTurn(tok, load_tools([gate.tool()]), parser=EveryTurnCalls("gate"), max_turns=3, tool_timeout=60)
    (group,) = mt.generate(backend_of(engine), records(tok, ["Wait for me."]), params(tok, 300), n=2)
    return gate, group


def test_a_waiting_tool_does_not_block_the_other_trajectories(tok, model, one_thread):
    gate, group = gated_rollout(tok, model, lambda engine: engine, wait=30.0)
    assert gate.released is True and gate.calls >= 3
    assert all(not c.info["tool_failures"] for c in group)
    assert sorted(c.info["turns"] for c in group) == [3, 3]  # the held trajectory went on after its tool answered


def test_the_synchronous_loop_would_wait_for_the_gate(tok, model, one_thread):
    """The check above can fail: turn by turn (a backend without ``serve``) the first call is never released."""
    gate, group = gated_rollout(tok, model, RecordingBackend, wait=1.0)
    assert gate.released is False
    assert sum(c.info["tool_failures"].get("raised", 0) for c in group) == 1


def test_the_async_loop_matches_the_synchronous_one_without_tools_timing(tok, model, one_thread):
    """With instant tools, the engine's asynchronous loop and the turn-by-turn loop over the same engine give the
    same trajectories when each samples a trajectory's turn from its own stream: here both are greedy."""
    def run(backend_of):
        engine = EngineRollout(seed=0)
        engine.bind(model, tok)
        mt = MultiTurn(tok, load_tools([jitter]), parser=EveryTurnCalls("jitter"), max_turns=3)
        greedy = SamplingParams(temperature=0.0, max_tokens=120, stop_token_ids=[tok.eos_token_id, *range(40, 70)])
        return mt.generate(backend_of(engine), records(tok, ["Go.", "Go on."]), greedy, n=1)

    SLEEPS.seed(0)
    a = run(lambda engine: engine)
    b = run(RecordingBackend)
    for x, y in zip([c for g in a for c in g], [c for g in b for c in g]):
        assert x.token_ids == y.token_ids and x.mask == y.mask
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    assert torch.tensor([c.info["turns"] for g in a for c in g]).min() >= 2


# ------------------------------------------------------------------------------ the hf backend (model.generate)
def hf_rollout(tok, model, sleep_seed: int, seed: int = 3, batch_size: int = 256):
    SLEEPS.seed(sleep_seed)
    hf = HFRollout(seed=seed, batch_size=batch_size)
    hf.bind(model, tok)
    mt = MultiTurn(tok, load_tools([jitter]), parser=EveryTurnCalls("jitter"), max_turns=4)
    return mt.generate(hf, records(tok, ["Count.", "Count again."]), params(tok, 160), n=3)


def test_hf_seeded_trajectories_do_not_depend_on_the_tools_timing(tok, model, one_thread):
    """``hf`` batches whichever trajectories are ready (different batches in the two runs, and batch_size 2 splits
    them differently again), yet each trajectory samples the same tokens: its draws are its own."""
    a = hf_rollout(tok, model, sleep_seed=1)
    b = hf_rollout(tok, model, sleep_seed=2, batch_size=2)
    flat_a, flat_b = [c for g in a for c in g], [c for g in b for c in g]
    assert sum(c.info["turns"] >= 2 for c in flat_a) >= 4
    assert len({tuple(c.token_ids) for c in flat_a}) == len(flat_a)
    for x, y in zip(flat_a, flat_b):
        assert x.token_ids == y.token_ids and x.mask == y.mask and x.finish_reason == y.finish_reason
        assert x.info == y.info
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    c = hf_rollout(tok, model, sleep_seed=1, seed=4)  # another seed samples other trajectories
    assert [x.token_ids for g in c for x in g] != [x.token_ids for x in flat_a]


def test_hf_and_engine_sample_the_same_trajectories_from_the_same_draws(tok, model, one_thread):
    """A second implementation: the engine (its own decoder, cache and sampler) with the same seed gives each
    trajectory the same random stream, so it must sample the very tokens ``hf`` sampled through generate's
    logits processor, with the same behaviour log-probs (log_softmax of the logits over the temperature)."""
    a = [c for g in hf_rollout(tok, model, sleep_seed=1) for c in g]
    b = [c for g in rollout(tok, model, sleep_seed=2) for c in g]  # EngineRollout(seed=3)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids and x.mask == y.mask
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)


def test_hf_a_waiting_tool_does_not_block_the_other_trajectories(tok, model, one_thread):
    def hf_of(_engine):
        hf = HFRollout(seed=0)
        hf.bind(model, tok)
        return hf

    gate, group = gated_rollout(tok, model, hf_of, wait=30.0)
    assert gate.released is True and gate.calls >= 3
    assert all(not c.info["tool_failures"] for c in group)
    assert sorted(c.info["turns"] for c in group) == [3, 3]


def test_hf_row_draws_sample_the_tempered_top_k_top_p_distribution():
    """The logits processor's choice against hand-worked values. Top-k/top-p: with top_k=3 and top_p=0.5 on logits
    [3, 2, 1, 0, -1] at temperature 0.5, the three best have tempered probabilities proportional to e^6, e^4, e^2,
    and e^6 / (e^6 + e^4 + e^2) = 0.867 >= 0.5 leaves only token 0, whatever the uniform. Inverse CDF: five equal
    logits pick index ceil((1 - u) * 5) - 1 for the row's uniform u, and the row's next token takes its stream's
    next uniform."""
    from rlflow.rollout.draws import RowDraws, stream_key, uniforms
    from rlflow.rollout.hf import RowDrawsSampler

    def pick(params, scores, keys, starts):
        draws = RowDraws()
        draws.add(keys, starts)
        out = RowDrawsSampler(params, draws)(torch.zeros(len(keys), 1, dtype=torch.long), scores)
        assert torch.isfinite(out).sum(dim=1).tolist() == [1] * len(keys)  # one possible token per row
        assert (out[torch.isfinite(out)] == 0).all()
        return out.argmax(dim=1).tolist()

    peaked = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 4)
    keys = [stream_key(5, j) for j in range(4)]
    assert pick(SamplingParams(temperature=0.5, top_k=3, top_p=0.5), peaked, keys, [0, 1, 2, 3]) == [0] * 4
    flat = torch.zeros(6, 5)
    keys = [stream_key(7, j) for j in range(3)] * 2
    starts = [0, 0, 0, 1, 1, 1]
    u = uniforms(np.array(keys, dtype=np.uint64), np.array(starts, dtype=np.uint64))
    expected = [math.ceil((1.0 - x) * 5) - 1 for x in u.tolist()]
    assert pick(SamplingParams(temperature=1.0), flat, keys, starts) == expected
    assert pick(SamplingParams(temperature=1.0), flat[:1], keys[4:5], starts[4:5]) == expected[4:5]  # alone
