"""Padding-free training: packing into token budgets, and packed log-probs/gradients equal to padded ones."""


from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlflow.data.experience import Experience
from rlflow.training.packing import (
    balance_pack_count,
    collate_packed,
    pack_experiences,
    pack_indices,
    packed_completion_logprobs,
    segment_layout,
    shared_head_length,
)


@pytest.fixture(scope="module")
def model(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model)


def experiences(seed: int, count: int = 7) -> list[Experience]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        prompt = [rng.randrange(4, 100) for _ in range(rng.randint(3, 25))]
        completion = [rng.randrange(4, 100) for _ in range(rng.randint(1, 15))]
        out.append(Experience(prompt, completion, [-1.0] * len(completion), 0.0, rng.uniform(-1, 1), i // 2, "stop", 0))
    return out


def padded_reference(model, exps: list[Experience], temperature: float) -> list[torch.Tensor]:
    """The plain path: each sequence alone, no padding at all, log_softmax(logits / T) of each completion token."""
    out = []
    for e in exps:
        logits = model(torch.tensor([e.prompt_ids + e.completion_ids])).logits[0]
        p = len(e.prompt_ids)
        logp = torch.log_softmax(logits[p - 1: -1].float() / temperature, dim=-1)
        out.append(logp.gather(1, torch.tensor(e.completion_ids)[:, None])[:, 0])
    return out


def reference_grads(model, refs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The gradients of the summed reference log-probs, per parameter (the model's grads left zeroed)."""
    model.zero_grad()
    sum(r.sum() for r in refs).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def assert_grads_equal(model, ref_grads: dict[str, torch.Tensor]) -> None:
    for name, p in model.named_parameters():
        if name in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[name], atol=1e-4, rtol=1e-4)


def random_groups(rng: random.Random, groups: int, prompt_len: tuple[int, int], completion_len: tuple[int, int]):
    """``groups`` random prompts of 3 random completions each, as experiences."""
    exps = []
    for g in range(groups):
        prompt = [rng.randrange(4, 100) for _ in range(rng.randint(*prompt_len))]
        for _ in range(3):
            completion = [rng.randrange(4, 100) for _ in range(rng.randint(*completion_len))]
            exps.append(Experience(prompt, completion, [0.0] * len(completion), 0.0, 0.0, g, "stop", 0))
    return exps


def row_queries(batch: dict[str, torch.Tensor]) -> dict[int, list[int]]:
    """Each attention row set's rows, as their query counts."""
    sets: dict[int, list[int]] = {}
    for first, keys, row_set in batch["attn_rows"].tolist():
        sets.setdefault(row_set, []).append(keys - first)
    return sets


def test_pack_indices_respects_the_budget_and_places_every_sequence_once():
    lengths = [5, 9, 3, 7, 2, 12, 4]
    packs = pack_indices(lengths, 12)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in p) <= 12 for p in packs)
    # first fit, longest first, by hand: 12 | 9+3 | 7+5 | 4+2
    assert sorted(map(sorted, packs)) == [[0, 3], [1, 2], [4, 6], [5]]
    assert pack_indices([20, 3], 10) == [[0], [1]]  # too long for the budget: a pack of its own
    with pytest.raises(ValueError, match="pack_max_length"):
        pack_indices([1], 0)


def test_collate_packed_restarts_positions_and_points_at_the_predicting_tokens():
    e1 = Experience([11, 12, 13], [21, 22], [0.0, 0.0], 0.0, 1.0, 0, "stop", 0)
    e2 = Experience([14, 15], [23], [0.0], 0.0, -1.0, 0, "length", 0)
    batch = collate_packed([e1, e2])
    assert batch["input_ids"].tolist() == [[11, 12, 13, 21, 22, 14, 15, 23]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert batch["logit_index"].tolist() == [2, 3, 6]  # 13 predicts 21, 21 predicts 22, 15 predicts 23
    assert batch["completion_mask"].tolist() == [[True, True], [True, False]]
    assert batch["truncated"].tolist() == [False, True]
    index, valid = segment_layout([5, 3])
    assert index.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 0, 0]]
    assert valid.tolist() == [[True] * 5, [True, True, True, False, False]]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_and_gradients_equal_unpadded_ones(model, attn):
    model.config._attn_implementation = attn
    try:
        exps = experiences(seed=1)
        refs = padded_reference(model, exps, temperature=0.7)
        ref_grads = reference_grads(model, refs)
        total = 0.0
        for micro in pack_experiences(exps, 40):  # several packs, several sequences per pack
            batch = collate_packed(micro)
            logprobs, entropy = packed_completion_logprobs(model, batch, temperature=0.7)
            for row, e in zip(logprobs, micro):
                (want,) = [r for r, x in zip(refs, exps) if x is e]
                torch.testing.assert_close(row[: len(e.completion_ids)], want, atol=1e-5, rtol=0)
                assert torch.all(row[len(e.completion_ids):] == 0)
            assert torch.all(entropy[batch["completion_mask"]] > 0)
            total = total + logprobs[batch["completion_mask"]].sum()
        total.backward()
        assert_grads_equal(model, ref_grads)
    finally:
        model.config._attn_implementation = "sdpa"
        model.zero_grad()


def test_shared_prompts_are_laid_once_and_stay_exact(model):
    """A group's prompt once, then each member's completion: log-probs and gradients as if each ran alone."""
    rng = random.Random(4)
    exps = random_groups(rng, 3, (4, 20), (1, 12))
    rng.shuffle(exps)
    refs = padded_reference(model, exps, 1.0)
    ref_grads = reference_grads(model, refs)
    packs = pack_experiences(exps, 60, share_prompts=True)
    assert sorted(id(e) for p in packs for e in p) == sorted(id(e) for e in exps)
    total = 0.0
    for micro in packs:
        batch = collate_packed(micro, share_prompts=True)
        unique_prompts = {(e.group, tuple(e.prompt_ids)) for e in micro}
        tokens = sum(len(p) for _, p in unique_prompts) + sum(len(e.completion_ids) for e in micro)
        assert batch["input_ids"].shape[1] == tokens <= 60 or len(unique_prompts) == 1
        logprobs, _ = packed_completion_logprobs(model, batch)
        for row, e in zip(logprobs, micro):
            (want,) = [r for r, x in zip(refs, exps) if x is e]
            torch.testing.assert_close(row[: len(e.completion_ids)], want, atol=1e-5, rtol=0)
        total = total + logprobs[batch["completion_mask"]].sum()
    total.backward()
    assert_grads_equal(model, ref_grads)
    model.zero_grad()
    shared = collate_packed([exps[0], exps[0]], share_prompts=True)
    assert shared["input_ids"].shape[1] == len(exps[0].prompt_ids) + 2 * len(exps[0].completion_ids)
    p = len(exps[0].prompt_ids)
    c = len(exps[0].completion_ids)
    assert shared["position_ids"][0, -c:].tolist() == list(range(p, p + c))


def test_shared_head_length_is_the_common_prefix_of_sixteen_tokens_or_more():
    head = list(range(4, 24))  # 20 tokens
    assert shared_head_length([head + [30, 31], head + [40], head]) == 20
    assert shared_head_length([head[:15] + [30], head[:15] + [40]]) == 0  # 15 common tokens: too short
    assert shared_head_length([head[:16] + [30], head[:16] + [40]]) == 16
    assert shared_head_length([head + [30]]) == 0  # one prompt: nothing to share
    assert shared_head_length([head + [1], head + [1]]) == 21  # identical prompts: all of it


def test_a_prompt_head_common_to_every_group_is_laid_once_and_stays_exact(model):
    """Groups whose prompts start with the same 20 tokens: the head once per pack, each group's tail (empty for
    one group, whose prompt is the head; a whole duplicate prompt for two others) once, log-probs and gradients as
    if each sequence ran alone, and the pack budget counts the head once."""
    rng = random.Random(7)
    head = [rng.randrange(4, 100) for _ in range(20)]
    tails = [[rng.randrange(4, 100) for _ in range(n)] for n in (6, 0, 11, 3)]
    tails.append(list(tails[2]))  # a fifth group with the third's prompt
    exps = []
    for g, tail in enumerate(tails):
        for _ in range(3):
            completion = [rng.randrange(4, 100) for _ in range(rng.randint(1, 9))]
            exps.append(Experience(head + tail, completion, [0.0] * len(completion), 0.0, 0.0, g, "stop", 0))
    refs = padded_reference(model, exps, 1.0)
    ref_grads = reference_grads(model, refs)
    completions = sum(len(e.completion_ids) for e in exps)
    budget = 20 + sum(len(t) for t in tails) + completions  # all of it fits once the head is counted once
    packs = pack_experiences(exps, budget, share_prompts=True)
    assert len(packs) == 1
    batch = collate_packed(packs[0], share_prompts=True)
    assert batch["input_ids"].shape[1] == budget  # not 5 x 20 head tokens: one
    assert batch["input_ids"][0, :20].tolist() == head and batch["position_ids"][0, :20].tolist() == list(range(20))
    sets = row_queries(batch)
    assert {0, 1, 2} <= set(sets)  # head, completions, the non-empty tails
    assert len(sets[2]) == 4  # four non-empty tails (the second group's prompt is the head)
    logprobs, _ = packed_completion_logprobs(model, batch)
    for row, e, want in zip(logprobs, packs[0], [refs[exps.index(e)] for e in packs[0]]):
        torch.testing.assert_close(row[: len(e.completion_ids)], want, atol=1e-5, rtol=0)
    logprobs[batch["completion_mask"]].sum().backward()
    assert_grads_equal(model, ref_grads)
    model.zero_grad()
    # one token less of budget: two packs, each within it (a pack of one group holds its whole prompt)
    packs = pack_experiences(exps, budget - 1, share_prompts=True)
    assert len(packs) == 2 and sorted(id(e) for p in packs for e in p) == sorted(id(e) for e in exps)
    assert all(collate_packed(p, share_prompts=True)["input_ids"].shape[1] <= budget - 1 for p in packs)


def test_many_completion_rows_are_attended_in_two_sets_by_length_and_stay_exact(model):
    """16 completion rows or more: those longer than the median are a set of their own (less padding per set)."""
    exps = random_groups(random.Random(11), 6, (4, 12), (1, 14))
    refs = padded_reference(model, exps, 1.0)
    ref_grads = reference_grads(model, refs)
    batch = collate_packed(exps, share_prompts=True)
    lengths = sorted(len(e.completion_ids) for e in exps)
    median = lengths[len(lengths) // 2]
    sets = row_queries(batch)
    assert sorted(sets[1]) == [n for n in lengths if n <= median]  # 18 rows: split at the median
    assert sorted(sets[3]) == [n for n in lengths if n > median]
    logprobs, _ = packed_completion_logprobs(model, batch)
    for row, e, want in zip(logprobs, exps, refs):
        torch.testing.assert_close(row[: len(e.completion_ids)], want, atol=1e-5, rtol=0)
    logprobs[batch["completion_mask"]].sum().backward()
    assert_grads_equal(model, ref_grads)
    model.zero_grad()
    assert 3 not in row_queries(collate_packed(exps[:15], share_prompts=True))  # 15 rows: one set


def test_equal_length_pack_takes_the_reshape_path_and_stays_exact(model):
    exps = [Experience([5 + i, 6, 7, 8], [9, 10 + i, 11], [0.0] * 3, 0.0, 0.0, 0, "stop", 0) for i in range(3)]
    with torch.no_grad():
        logprobs, _ = packed_completion_logprobs(model, collate_packed(exps))
        refs = padded_reference(model, exps, 1.0)
    for row, ref in zip(logprobs, refs):
        torch.testing.assert_close(row, ref, atol=1e-5, rtol=0)


def test_balance_pack_count_splits_the_largest_packs_until_ranks_agree():
    exps = [
        Experience([1] * 10, [2] * n, [0.0] * n, 0.0, 0.0, i // 2, "stop", 0) for i, n in enumerate((1, 5, 2, 9, 3))
    ]
    packs = [exps[:4], exps[4:]]  # 57 and 13 tokens
    balanced = balance_pack_count(packs, 4)
    assert [e for p in balanced for e in p] == exps  # every sequence once, in order
    # the 4-sequence pack is halved (26 + 31 tokens), then the larger half (31) again
    assert balanced == [exps[:2], [exps[2]], [exps[3]], [exps[4]]]
    assert balance_pack_count(packs, 2) == packs
    with pytest.raises(ValueError, match="cannot split"):
        balance_pack_count([[exps[0]]], 2)

