"""The ``engine`` rollout backend: sampling distribution, shared-prefix cache exactness, stops, log-probs, streaming."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from rlflow import registry
from rlflow.rollout.base import SamplingParams
from rlflow.rollout.decode_state import DecodeState
from rlflow.rollout.engine import EngineRollout, cache_kwargs, common_prefix_len
from rlflow.rollout.fused import FusedDecoder
from rlflow.rollout.hf import HFRollout


def chi2_quantile_999(df: int) -> float:
    """99.9% quantile of the chi-square distribution (Wilson-Hilferty; within 1% of the exact value for df >= 3)."""
    z = 3.0902  # standard normal 99.9% quantile
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


@pytest.fixture(scope="module")
def model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model).eval()


def engine(model, tokenizer, **kwargs) -> EngineRollout:
    e = EngineRollout(**kwargs)
    e.bind(model, tokenizer)
    return e


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 100) for _ in range(n)] for n in lengths]


@torch.no_grad()
def next_token_probs(model, ids: list[int], temperature: float) -> torch.Tensor:
    """The plain path: one full forward pass, softmax of the last logits over the temperature."""
    logits = model(torch.tensor([ids])).logits[0, -1].double()
    return torch.softmax(logits / temperature, dim=-1)


def truncated(probs: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """Top-k / top-p / min-p truncation written from their definitions, renormalised."""
    order = torch.argsort(probs, descending=True).tolist()
    kept_by_k = order[:top_k] if top_k else order
    k_mass = float(probs[kept_by_k].sum())  # top-p measures mass after top-k's renormalisation
    keep, mass = [], 0.0
    for tok in kept_by_k:
        if top_p < 1.0 and mass >= top_p:
            break
        keep.append(tok)
        mass += float(probs[tok]) / k_mass
    best = float(probs[order[0]])
    keep = [tok for tok in keep if float(probs[tok]) >= min_p * best]
    out = torch.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic over the tokens with non-zero expected probability; asserts none outside them."""
    support = expected_probs > 0
    assert counts[~support].sum() == 0, "sampled a token outside the truncated support"
    n = counts.sum()
    expected = expected_probs[support] * n
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return stat, int(support.sum()) - 1


def assert_logprobs_match_a_full_forward(model, prompts, groups, temperature: float, atol: float = 2e-5) -> None:
    """Each completion's returned log-probs equal log_softmax(logits / T) of one plain forward over the sequence."""
    for prompt, group in zip(prompts, groups):
        for c in group:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1: -1].double()
            ref = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(c.logprobs, dtype=torch.float64), ref, atol=atol, rtol=0)


def test_registered_as_engine():
    assert isinstance(registry.build("rlflow.rollout", "engine"), EngineRollout)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [(0.7, 5, 1.0, 0.0), (1.3, 0, 0.3, 0.0),
                                                           (1.3, 0, 1.0, 0.75), (1.5, 12, 0.9, 0.8)])
def test_first_token_distribution_matches_plain_softmax(model, tokenizer, temperature, top_k, top_p, min_p):
    prompt = prompts_of([17], seed=3)[0]
    e = engine(model, tokenizer, seed=1)
    params = SamplingParams(temperature, top_p, top_k, max_tokens=1, min_p=min_p)
    (group,) = e.generate([prompt], params, n=4000)
    counts = torch.bincount(torch.tensor([c.token_ids[0] for c in group]), minlength=model.config.vocab_size).double()
    expected = truncated(next_token_probs(model, prompt, temperature), top_k, top_p, min_p)
    if min_p:  # min-p really drops tokens that the other settings keep
        assert (expected > 0).sum() < (truncated(next_token_probs(model, prompt, temperature), top_k, top_p) > 0).sum()
    stat, df = chi_square(counts, expected)
    assert df >= 3 and float(expected[expected > 0].min()) * 4000 >= 5
    assert stat < chi2_quantile_999(df), (stat, df)


def test_second_token_distribution_matches_plain_softmax(model, tokenizer):
    """The decode path (shared prompt cache + own suffix): the next-token law given the first sampled token."""
    prompt = prompts_of([11], seed=5)[0]
    e = engine(model, tokenizer, seed=2)
    params = SamplingParams(1.0, 1.0, 4, max_tokens=2)
    (group,) = e.generate([prompt], params, n=6000)
    firsts = torch.tensor([c.token_ids[0] for c in group])
    first = int(torch.mode(firsts).values)
    seconds = torch.tensor([c.token_ids[1] for c in group if c.token_ids[0] == first])
    assert len(seconds) > 500
    counts = torch.bincount(seconds, minlength=model.config.vocab_size).double()
    stat, df = chi_square(counts, truncated(next_token_probs(model, prompt + [first], 1.0), top_k=4))
    assert stat < chi2_quantile_999(df), (stat, df)


@torch.no_grad()
@pytest.mark.parametrize("fused,head", [(False, 0), (True, 0), (True, 20)])
def test_shared_prefix_cache_gives_the_same_next_token_distribution_as_separate_prefills(model, tokenizer, fused, head):
    """Decode steps over the group caches (model forward or fused decoder; a prefill with or without a prompt head
    common to the batch run once) give the next-token distribution of one plain forward over the whole sequence."""
    e = engine(model, tokenizer)
    common = prompts_of([head], seed=9)[0]
    prompts = [common + p for p in prompts_of([9, 23], seed=7)]  # different lengths: the prompt caches are padded
    decoder = FusedDecoder(model) if fused else None
    shared = e._prefill_head(common, torch.device("cpu")) if head else None  # the head every prompt starts with
    n = 3
    keys, values, mask, _ = e._prefill(prompts, torch.device("cpu"), shared)
    state = DecodeState(n, max_tokens=8, head=shared)
    state.add_groups([0, 1], keys, values, mask)
    third = common + prompts_of([15], seed=8)[0]  # a group that joins the running batch later
    rng = random.Random(0)
    seqs = [list(prompts[g]) for g in range(2) for _ in range(n)]
    pos = torch.tensor([len(s) for s in seqs])
    for step in range(5):
        if step == 2:
            k3, v3, m3, _ = e._prefill([third], torch.device("cpu"), shared)
            state.add_groups([2], k3, v3, m3)
            seqs += [list(third) for _ in range(n)]
            pos = torch.cat([pos, torch.full((n,), len(third))])
        if step == 3:  # the first group finishes and leaves (rows leave by whole groups); the others differ in length
            keep = torch.tensor([j for j in range(len(seqs)) if j >= n])
            state.keep_rows(keep)
            seqs = [seqs[j] for j in keep.tolist()]
            pos = pos[keep]
        feed = torch.tensor([rng.randrange(4, 100) for _ in seqs])
        logits = e._decode_step(state, feed, pos, decoder)
        pos = pos + 1
        for j, tok in enumerate(feed.tolist()):
            seqs[j].append(tok)
            plain = model(torch.tensor([seqs[j]])).logits[0, -1]
            torch.testing.assert_close(
                torch.log_softmax(logits[j], -1), torch.log_softmax(plain, -1), atol=1e-5, rtol=0
            )


def test_rows_leave_the_decode_state_by_whole_groups(model, tokenizer):
    e = engine(model, tokenizer)
    keys, values, mask, _ = e._prefill(prompts_of([6, 9]), torch.device("cpu"))
    state = DecodeState(3, max_tokens=4)
    state.add_groups([0, 1], keys, values, mask)
    with pytest.raises(ValueError, match="whole groups of 3 rows"):
        state.keep_rows(torch.tensor([0, 1, 3, 4, 5]))
    state.keep_rows(torch.tensor([3, 4, 5]))
    assert state.group_prompt == [1] and state.k[0].shape[0] == 1


@pytest.mark.parametrize("max_tokens,fused", [(10, True), (10, False), (70, True)])
def test_logprobs_match_a_full_forward_pass(model, tokenizer, max_tokens, fused):
    """70 tokens: the generated-token caches grow twice (32 -> 64 -> 70) on the way."""
    torch.manual_seed(0)
    prompts = prompts_of([5, 30, 12], seed=1)
    e = engine(model, tokenizer, max_batch_size=4, prefill_batch_size=1, fused=fused)  # prompts join mid-run
    params = SamplingParams(0.8, 0.9, 20, max_tokens=max_tokens)
    groups = e.generate(prompts, params, n=2)
    for group in groups:
        assert len(group) == 2
    assert_logprobs_match_a_full_forward(model, prompts, groups, temperature=0.8)


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt2"])
def test_decode_through_other_architectures_forward_matches_a_full_forward_pass(name):
    """The unfused path (FSDP-sharded weights, or architectures without a fused forward) hands the decode state to
    the attention function as a keyword argument, so it works for models that rebuild their own attention mask
    (Llama, Mistral) or never take a mask mapping (GPT-2), with a shared head and prompts joining mid-run."""
    from tests.helpers.tiny_archs import IdTokenizer, tiny_causal_lm

    torch.manual_seed(0)
    model = tiny_causal_lm(name)
    head = prompts_of([6], seed=3)[0]
    prompts = [head + p for p in prompts_of([2, 9, 4], seed=2)]
    e = engine(model, IdTokenizer(), max_batch_size=4, prefill_batch_size=1, fused=False, min_shared_prefix=4)
    groups = e.generate(prompts, SamplingParams(0.8, max_tokens=9), n=2)
    assert_logprobs_match_a_full_forward(model, prompts, groups, temperature=0.8)


def test_uninitialised_cache_memory_is_never_read(model, tokenizer, monkeypatch):
    """The caches are allocated uninitialised where every slot is written before it is read; poisoned with NaN,
    a rollout whose groups join behind running ones (per-group lengths, masked unwritten slots) stays exact."""
    original = torch.Tensor.new_empty

    def poisoned(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    monkeypatch.setattr(torch.Tensor, "new_empty", poisoned)
    joins = []  # tokens already decoded by the running groups when a group joins (None: per-group lengths)
    add_groups = DecodeState.add_groups
    monkeypatch.setattr(DecodeState, "add_groups", lambda self, *a: joins.append(self.fed) or add_groups(self, *a))
    prompts = prompts_of([5, 30, 12, 7, 9, 16], seed=6)
    stops = torch.argsort(next_token_probs(model, prompts[0], 1.0), descending=True)[:6].tolist()  # early, varied ends
    e = engine(model, tokenizer, max_batch_size=4, prefill_batch_size=1, seed=0)
    groups = e.generate(prompts, SamplingParams(0.8, max_tokens=24, stop_token_ids=stops), n=2)
    assert any(fed != 0 for fed in joins), joins  # some group joined behind running ones
    assert_logprobs_match_a_full_forward(model, prompts, groups, temperature=0.8)


def test_stop_tokens_and_max_tokens_are_exact(model, tokenizer):
    prompts = prompts_of([8, 14, 21], seed=2)
    probs = next_token_probs(model, prompts[0], 1.0)
    stops = torch.argsort(probs, descending=True)[:6].tolist()  # likely tokens, so many completions stop
    e = engine(model, tokenizer, seed=3, max_batch_size=8)
    groups = e.generate(prompts, SamplingParams(1.0, max_tokens=9, stop_token_ids=stops), n=8)
    reasons = set()
    for group in groups:
        for c in group:
            assert 1 <= len(c.token_ids) <= 9 and len(c.logprobs) == len(c.token_ids)
            assert not set(c.token_ids[:-1]) & set(stops), "generation went on past a stop token"
            if c.finish_reason == "stop":
                assert c.token_ids[-1] in stops
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == 9 and c.token_ids[-1] not in stops
            reasons.add(c.finish_reason)
    assert reasons == {"stop", "length"}
    (one,) = e.generate(prompts[:1], SamplingParams(1.0, max_tokens=1), n=5)
    assert all(len(c.token_ids) == 1 for c in one)


def test_greedy_matches_model_generate(model, tokenizer):
    prompts = prompts_of([6, 25, 13], seed=4)
    params = SamplingParams(0.0, max_tokens=12, stop_token_ids=[tokenizer.eos_token_id])
    hf = HFRollout()
    hf.bind(model, tokenizer)
    mine = engine(model, tokenizer, max_batch_size=4).generate(prompts, params, n=2)
    for a, b in zip(hf.generate(prompts, params, n=2), mine):
        assert [c.token_ids for c in a] == [c.token_ids for c in b]
        assert [c.finish_reason for c in a] == [c.finish_reason for c in b]


def test_stream_yields_finished_groups_before_the_last_prompt_is_prefilled(model, tokenizer, monkeypatch):
    e = engine(model, tokenizer, seed=0, max_batch_size=4, prefill_batch_size=1)
    prefills = []
    original = e._prefill
    monkeypatch.setattr(e, "_prefill", lambda p, d, head=None: prefills.append(len(p)) or original(p, d, head))
    prompts = prompts_of([7, 9, 11, 13, 15], seed=6)
    seen = []
    for index, group in e.stream(prompts, SamplingParams(1.0, max_tokens=5), n=2):
        seen.append((index, len(prefills)))
        assert len(group) == 2
    assert sorted(i for i, _ in seen) == list(range(5))
    assert seen[0][1] < len(prompts), "the first group should be ready while prompts still wait"
    assert model.config._attn_implementation != "rlflow_shared_prefix"  # restored after decoding


def test_bad_arguments_are_refused(model, tokenizer):
    with pytest.raises(ValueError, match="max_batch_size"):
        EngineRollout(max_batch_size=0)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine(model, tokenizer).generate([[5], []], SamplingParams(max_tokens=2), n=2)


def test_common_prefix_len_leaves_every_prompt_a_token():
    assert common_prefix_len([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9]]) == 2
    assert common_prefix_len([[1, 2], [1, 2, 3]]) == 1  # the shorter prompt keeps its last token
    assert common_prefix_len([[7], [7]]) == 0


@pytest.mark.parametrize("fused", [False, True])
def test_prefill_after_a_shared_head_returns_the_separate_prefills_last_logits(model, tokenizer, fused):
    """Through the model's forward (left-padded rests) and the fused decoder (right-padded): the same last logits
    as a plain forward of each whole prompt, and the same keys/values of each prompt's real tokens."""
    common = prompts_of([24], seed=11)[0]
    prompts = [common + p for p in prompts_of([3, 11, 1], seed=12)]
    e = engine(model, tokenizer)
    e._decoder = FusedDecoder(model) if fused else None
    head_keys, head_values = e._prefill_head(common, torch.device("cpu"))
    assert head_keys[0].shape == (model.config.num_key_value_heads, 24, model.config.head_dim)  # one copy, no batch
    keys, values, mask, logits = e._prefill(prompts, torch.device("cpu"), (head_keys, head_values))
    assert mask.shape == (3, 11) and mask.sum(1).tolist() == [3, 11, 1]  # only each prompt's rest, padded
    assert keys[0].shape[:3] == (3, model.config.num_key_value_heads, 11)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            plain_cache = DynamicCache(config=model.config)
            plain = model(torch.tensor([p]), use_cache=True, **cache_kwargs(model, plain_cache)).logits[0, -1]
        torch.testing.assert_close(logits[i], plain, atol=1e-5, rtol=0)
        real = mask[i].bool()
        for layer in range(model.config.num_hidden_layers):
            plain_layer = plain_cache.layers[layer]
            torch.testing.assert_close(keys[layer][i][:, real], plain_layer.keys[0, :, 24:], atol=1e-5, rtol=0)
            torch.testing.assert_close(values[layer][i][:, real], plain_layer.values[0, :, 24:], atol=1e-5, rtol=0)
        torch.testing.assert_close(head_keys[0], plain_cache.layers[0].keys[0, :, :24], atol=1e-5, rtol=0)


def test_a_head_common_to_every_prompt_is_prefilled_once(model, tokenizer, monkeypatch):
    common = prompts_of([20], seed=13)[0]
    prompts = [common + p for p in prompts_of([4, 9, 2, 6], seed=14)]
    e = engine(model, tokenizer, seed=1, max_batch_size=4, prefill_batch_size=1, min_shared_prefix=16)
    heads, rests = [], []
    original_head, original = e._prefill_head, e._prefill
    monkeypatch.setattr(e, "_prefill_head", lambda h, d: heads.append(len(h)) or original_head(h, d))
    monkeypatch.setattr(e, "_prefill", lambda p, d, head=None: rests.append(head is not None) or original(p, d, head))
    groups = e.generate(prompts, SamplingParams(1.0, max_tokens=6), n=2)
    assert heads == [20] and rests == [True] * 4 and len(groups) == 4
    heads.clear()
    short = engine(model, tokenizer, min_shared_prefix=21)  # the common head is shorter than the threshold
    monkeypatch.setattr(short, "_prefill_head", lambda h, d: heads.append(len(h)) or original_head(h, d))
    short.generate(prompts, SamplingParams(1.0, max_tokens=3), n=2)
    off = engine(model, tokenizer, min_shared_prefix=0)  # 0 disables the shared head
    monkeypatch.setattr(off, "_prefill_head", lambda h, d: heads.append(len(h)) or original_head(h, d))
    off.generate(prompts, SamplingParams(1.0, max_tokens=3), n=2)
    assert heads == []


def _modes() -> tuple[bool, bool]:
    return torch.is_inference_mode_enabled(), torch.is_grad_enabled()


@pytest.mark.parametrize("gloo", [False, True])
def test_decoding_runs_in_inference_mode_and_the_caller_keeps_its_own_between_groups(model, tokenizer, tmp_path, gloo):
    """The decode loop runs in ``torch.inference_mode`` (no autograd view or version tracking), entered at every
    resume of the stream and left at every yield; under a gloo process group, whose threads do not carry inference
    mode (pytorch#86830), in ``no_grad``."""
    import torch.distributed as dist

    e = engine(model, tokenizer, seed=0, max_batch_size=4, prefill_batch_size=1)
    inside, between = [], []
    e.step_hook = lambda iteration: inside.append(_modes()) or False
    if gloo:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        with torch.enable_grad():
            for _, group in e.stream(prompts_of([7, 9, 11, 13, 15], seed=6), SamplingParams(1.0, max_tokens=5), n=2):
                between.append(_modes())
                assert all(isinstance(x, float) for c in group for x in c.logprobs)  # numbers, not inference tensors
    finally:
        if gloo:
            dist.destroy_process_group()
    assert inside and set(inside) == {(False, False) if gloo else (True, False)}
    assert len(between) == 5 and set(between) == {(False, True)}


def test_an_fsdp_sharded_model_decodes_in_no_grad(tmp_path, monkeypatch):
    """FSDP2's unsharded weights and hooks stay in the mode FSDP2 is tested in: ``no_grad``, also where the
    backend is not gloo (a GPU's nccl, stood in for here); a plain model decodes in inference mode."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from rlflow.rollout.hardware import inference_context

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        plain, sharded = torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.nn.Sequential(torch.nn.Linear(4, 4))
        fully_shard(sharded[0])
        assert isinstance(inference_context(plain), torch.no_grad)  # gloo
        monkeypatch.setattr(dist, "get_backend", lambda *args, **kwargs: "nccl")
        assert isinstance(inference_context(plain), torch.inference_mode)
        assert isinstance(inference_context(sharded), torch.no_grad)
    finally:
        monkeypatch.undo()
        dist.destroy_process_group()
