"""The engine continues a trajectory from its own KV cache across turns (rlflow.rollout.continuation): only the
appended tokens are prefilled (counted), the sampled ids equal those of a re-prefill with the same random draws,
and every sampled token's log-prob equals a plain full forward of the whole sequence."""

from __future__ import annotations

import pytest
import torch

from rlflow.data.dataset import PromptRecord
from rlflow.rollout.base import SamplingParams
from rlflow.rollout.continuation import SessionCache
from rlflow.rollout.engine import EngineRollout, common_prefix_len
from rlflow.rollout.multiturn import MultiTurn, RecordsRollout
from tests.helpers.multiturn_helpers import qwen3_char_tokenizer, tiny_model


@pytest.fixture(scope="module")
def tok():
    return qwen3_char_tokenizer()


def full_forward_logprobs(model, prefix: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of ``tokens`` after ``prefix``, from one plain forward over the whole sequence."""
    with torch.no_grad():
        logits = model(torch.tensor([prefix + tokens])).logits[0, len(prefix) - 1: -1].double()
    return torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


def three_turns(engine: EngineRollout, prompts, params, inserts, n: int, keep: bool):
    """Turn 1 with ``n`` samples per prompt, then two turns of every row with ``inserts[turn][row]`` appended;
    return the prompts of each turn, its completions and the prefilled/reused token counts per turn."""
    import contextlib

    turns = []
    with engine.keep_caches() if keep else contextlib.nullcontext():
        current = prompts
        for turn in range(3):
            before = engine.prefilled_tokens, engine.reused_tokens
            groups = engine.generate(current, params, n=n if turn == 0 else 1)
            outs = [c for g in groups for c in g]
            turns.append((current, outs, engine.prefilled_tokens - before[0], engine.reused_tokens - before[1]))
            if turn == 2:
                break
            if turn == 0:
                current = [p for p in prompts for _ in range(n)]
            current = [p + c.token_ids + inserts[turn][i] for i, (p, c) in enumerate(zip(current, outs))]
    return turns


@pytest.mark.parametrize("fused,max_batch_size,shared", [(True, 256, 0), (True, 2, 0), (False, 256, 0),
                                                         (True, 256, 16), (False, 256, 16)])
def test_continuation_prefills_only_the_new_tokens_and_matches_a_full_forward(tok, one_thread, fused, max_batch_size,
                                                                              shared):
    """max_batch_size 2: continued rows join behind running ones; shared: turn 1's prompts share a 20-token head
    prefilled once (each row's kept cache then starts with the head's keys/values)."""
    model = tiny_model(len(tok))
    g = torch.Generator().manual_seed(1)
    vocab = len(tok)
    head = torch.randint(0, vocab, (20 if shared else 0,), generator=g).tolist()
    prompts = [head + torch.randint(0, vocab, (k,), generator=g).tolist() for k in (9, 14)]
    n, rows = 2, 4
    inserts = [[torch.randint(0, vocab, (int(k),), generator=g).tolist()
                for k in torch.randint(1, 6, (rows,), generator=g)] for _ in range(2)]
    stop = tok.eos_token_id
    params = SamplingParams(temperature=1.3, max_tokens=12, stop_token_ids=[stop])
    runs = {}
    for keep in (True, False):
        engine = EngineRollout(seed=3, fused=fused, max_batch_size=max_batch_size, min_shared_prefix=shared)
        engine.bind(model, tok)
        runs[keep] = three_turns(engine, prompts, params, inserts, n, keep)
    for turn, ((cur, outs, prefilled, reused), (cur_re, outs_re, prefilled_re, _)) in enumerate(
            zip(runs[True], runs[False])):
        # the same random draws give the same ids as re-prefilling the history (logits agree to float rounding)
        assert cur == cur_re and [c.token_ids for c in outs] == [c.token_ids for c in outs_re]
        # re-prefill: the whole history, every turn (a head common to all prompts once)
        common = common_prefix_len(cur) if shared and common_prefix_len(cur) >= shared else 0
        assert prefilled_re == sum(len(p) for p in cur) - (len(cur) - 1) * common
        if turn == 0:
            assert prefilled == prefilled_re and reused == 0 and common == (20 if shared else 0)
        else:  # continuation: the previous turn's last sampled token (not fed yet) and the inserted tokens only
            assert prefilled == sum(1 + len(ins) for ins in inserts[turn - 1])
            assert reused == sum(len(p) for p in cur) - prefilled
        for p, c, c_re in zip([p for p in cur for _ in range(n if turn == 0 else 1)], outs, outs_re):
            ref = full_forward_logprobs(model, p, c.token_ids, params.temperature)
            torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), ref, atol=2e-5, rtol=0)
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(c_re.logprobs), atol=2e-5, rtol=0)
    assert any(len(c.token_ids) > 1 for _, outs, _, _ in runs[True][1:] for c in outs)


def test_session_cache_takes_the_longest_kept_prefix_once():
    cache = SessionCache()
    a, b = ([torch.zeros(1)], [torch.zeros(1)]), ([torch.ones(1)], [torch.ones(1)])
    cache.put([1, 2], a)
    cache.put([1, 2, 3], b)
    assert cache.take([1, 2, 3]) == (2, a)  # a kept prefix must leave a token to prefill
    assert cache.take([1, 2, 3, 4]) == (3, b)
    assert cache.take([1, 2, 3, 4]) is None and len(cache) == 0
    cache.put([5], a)
    assert cache.take([6, 7]) is None and len(cache) == 1


class Lower:
    """An environment that answers every turn with "lower" (a random model never ends the game)."""

    def reset(self, row):
        return None

    def step(self, text):
        from rlflow.environments import EnvStep

        return EnvStep([{"role": "user", "content": "lower"}], reward=-0.25)


def test_multiturn_on_the_engine_prefills_only_appended_tokens(tok, one_thread):
    from rlflow.environments import Environment

    class Env(Lower, Environment):
        pass

    model = tiny_model(len(tok))
    engine = EngineRollout(seed=0, min_shared_prefix=0)
    engine.bind(model, tok)
    recs = []
    for q in ("Guess a number.", "Guess again, please."):
        prompt = [{"role": "user", "content": q}]
        text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        recs.append(PromptRecord(prompt, {}, "t.jsonl:1", tok.encode(text, add_special_tokens=False), text))
    # short turns whatever the random model samples: 30 of the 101 characters end a turn too
    params = SamplingParams(temperature=1.0, max_tokens=60, stop_token_ids=[tok.eos_token_id, *range(40, 70)])
    mt = MultiTurn(tok, {}, environment=Env(), max_turns=3)
    before = engine.prefilled_tokens
    # through the trainer's path: the datamodule hands the judging code a RecordsRollout over the engine
    groups = RecordsRollout(mt, engine, recs).generate([r.prompt_ids for r in recs], params, n=2)
    # with an environment every trajectory's first turn is its own prompt (the environment may rewrite it)
    expected, inserted_runs = 2 * sum(len(r.prompt_ids) for r in recs), 0
    for rec, group in zip(recs, groups):
        for c in group:
            mask = c.mask + [True]
            starts = [i for i in range(len(c.mask)) if not mask[i] and (i == 0 or mask[i - 1])]
            for s in starts:  # each inserted run: itself plus the model's last token before it
                run = next(i for i in range(s, len(mask)) if mask[i]) - s
                expected += 1 + run
                inserted_runs += 1
            ref = full_forward_logprobs(model, rec.prompt_ids, c.token_ids, 1.0)
            sampled = torch.tensor(c.mask)
            torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64)[sampled], ref[sampled],
                                       atol=2e-5, rtol=0)
    assert inserted_runs > 0
    assert engine.prefilled_tokens - before == expected
    assert engine.session is None  # the kept caches are dropped with the rollout call
