"""Chunked log-probs and entropy: equal to the plain full-logits computation (values and gradients), and the LM
head is never applied to more than ``chunk_size`` positions at once, forward or backward."""

from __future__ import annotations

import pytest
import torch

from rlflow.data.experience import Experience, collate
from rlflow.training import logprobs
from rlflow.training.logprobs import completion_logprobs, naive_token_stats, token_stats_from_hidden


def plain_stats(logits, targets, temperature):
    """log p(target) and -sum p log p, written from the definitions."""
    z = logits.double() / temperature
    logp = z - torch.logsumexp(z, dim=-1, keepdim=True)
    taken = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return taken, -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("block_rows", [None, 3])
@pytest.mark.parametrize("chunk_size", [1, 5, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_plain_with_gradients(chunk_size, temperature, block_rows, monkeypatch):
    if block_rows:  # chunks handled in blocks of 3 rows (the default takes a 97-word chunk in one block)
        monkeypatch.setattr(logprobs, "BLOCK_BYTES", 4 * 97 * block_rows)
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 97, bias=True)
    hidden = torch.randn(3, 11, 16, requires_grad=True)
    targets = torch.randint(0, 97, (3, 11))
    up = torch.randn(3, 11)  # upstream gradients for both outputs
    ue = torch.randn(3, 11)
    lp, ent = token_stats_from_hidden(hidden, targets, head, temperature, chunk_size)
    (lp * up + ent * ue).sum().backward()
    got = hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()
    hidden.grad = None
    head.zero_grad()
    lp2, ent2 = plain_stats(head(hidden), targets, temperature)
    (lp2 * up + ent2 * ue).sum().backward()
    torch.testing.assert_close(lp, lp2.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent2.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[0], hidden.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[1], head.weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[2], head.bias.grad, rtol=1e-4, atol=1e-5)
    # the fallback path on full logits agrees too
    lp3, ent3 = naive_token_stats(head(hidden).detach(), targets, temperature)
    torch.testing.assert_close(lp3, lp2.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent3, ent2.float(), rtol=1e-5, atol=1e-5)


def test_gradients_with_one_output_unused_frozen_head_and_bfloat16():
    torch.manual_seed(1)
    head = torch.nn.Linear(8, 33, bias=False)
    hidden = torch.randn(2, 5, 8, requires_grad=True)
    targets = torch.randint(0, 33, (2, 5))
    for use_lp, use_ent in ((True, False), (False, True)):
        hidden.grad = None
        head.zero_grad()
        lp, ent = token_stats_from_hidden(hidden, targets, head, 1.3, 3)
        ((lp.sum() if use_lp else 0) + (ent.sum() if use_ent else 0)).backward()
        got = hidden.grad.clone(), head.weight.grad.clone()
        hidden.grad = None
        head.zero_grad()
        lp2, ent2 = plain_stats(head(hidden), targets, 1.3)
        ((lp2.sum() if use_lp else 0) + (ent2.sum() if use_ent else 0)).backward()
        torch.testing.assert_close(got[0], hidden.grad, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[1], head.weight.grad, rtol=1e-4, atol=1e-5)
    head.requires_grad_(False)  # a frozen head: only the hidden states get a gradient
    hidden.grad = None
    before = head.weight.grad.clone()
    lp, _ = token_stats_from_hidden(hidden, targets, head, 1.0, 4)
    lp.sum().backward()
    assert hidden.grad is not None and torch.equal(head.weight.grad, before)
    bf_head = torch.nn.Linear(8, 33, bias=False).to(torch.bfloat16)
    bf_hidden = torch.randn(2, 5, 8, dtype=torch.bfloat16, requires_grad=True)
    lp, ent = token_stats_from_hidden(bf_hidden, targets, bf_head, 1.0, 4)
    assert lp.dtype == torch.float32 and bf_hidden.grad is None
    (lp.sum() + ent.sum()).backward()
    assert bf_hidden.grad.dtype == torch.bfloat16 and bf_head.weight.grad.dtype == torch.bfloat16
    ref_h = bf_hidden.detach().float().requires_grad_(True)
    lp2, ent2 = plain_stats(torch.nn.functional.linear(ref_h, bf_head.weight.float()), targets, 1.0)
    (lp2.sum() + ent2.sum()).backward()
    torch.testing.assert_close(bf_hidden.grad.float(), ref_h.grad, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("keep_logits", [True, False])
@pytest.mark.parametrize("block_rows", [None, 2])
def test_under_bf16_autocast_stats_are_float32_and_backward_recomputes_like_forward(block_rows, keep_logits,
                                                                                    monkeypatch):
    """trainer.precision=bf16-mixed: the LM head runs in bf16 (forward and the recomputing backward, even when
    backward is called outside autocast), log-probs and entropy are float32 stats of those bf16 logits; the
    backward pass gives the same gradients from the logits the forward kept and from its own recomputation."""
    if block_rows:
        monkeypatch.setattr(logprobs, "BLOCK_BYTES", 4 * 97 * block_rows)
    if not keep_logits:  # nothing kept: every chunk's product is recomputed in the backward pass
        monkeypatch.setattr(logprobs, "KEEP_LOGITS_BYTES", 0)
    torch.manual_seed(2)
    head = torch.nn.Linear(16, 97, bias=True)
    hidden = torch.randn(3, 11, 16, requires_grad=True)
    targets = torch.randint(0, 97, (3, 11))
    up, ue = torch.randn(3, 11), torch.randn(3, 11)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = token_stats_from_hidden(hidden, targets, head, 0.7, 4)
        logits = head(hidden)  # the reference: autograd through autocast's own bf16 linear
    assert lp.dtype == ent.dtype == torch.float32 and logits.dtype == torch.bfloat16
    (lp * up + ent * ue).sum().backward()
    got = hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone()
    hidden.grad = None
    head.zero_grad()
    lp2, ent2 = plain_stats(logits, targets, 0.7)
    (lp2 * up + ent2 * ue).sum().backward()
    torch.testing.assert_close(lp, lp2.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ent2.float(), rtol=1e-5, atol=1e-5)
    # the hidden-state gradient is the same bf16 matmul as autograd's (a float32 recomputation is ~3e-3 off);
    # the head's gradients are accumulated in float32 here, in bf16 by autograd
    for mine, ref, tol in zip(got, (hidden.grad, head.weight.grad, head.bias.grad), (1e-3, 1e-2, 1e-2)):
        assert (mine - ref).abs().max() <= tol * ref.abs().max()


def test_the_lm_head_never_sees_more_than_a_chunk(monkeypatch):
    vocab, chunk = 101, 8
    head = torch.nn.Linear(12, vocab, bias=False)
    hidden = torch.randn(4, 10, 12, requires_grad=True)
    targets = torch.randint(0, vocab, (4, 10))
    rows = []
    real_linear = torch.nn.functional.linear

    def spy(x, w, b=None):
        out = real_linear(x, w, b)
        if out.shape[-1] == vocab:
            rows.append(out.numel() // vocab)
        return out

    monkeypatch.setattr(torch.nn.functional, "linear", spy)
    lp, ent = token_stats_from_hidden(hidden, targets, head, 1.0, chunk)
    (lp.sum() + ent.sum()).backward()
    # 40 positions in chunks of 8: 5 forward applications; the backward pass takes the kept logits
    assert max(rows) <= chunk and len(rows) == 5 and sum(rows) == 40
    kept_grad = hidden.grad.clone(), head.weight.grad.clone()
    for budget, applications in ((0, 10), (2 * 8 * vocab * 4, 8)):  # none kept; the first two chunks kept
        monkeypatch.setattr(logprobs, "KEEP_LOGITS_BYTES", budget)
        rows.clear()
        hidden.grad, head.weight.grad = None, None
        lp, ent = token_stats_from_hidden(hidden, targets, head, 1.0, chunk)
        (lp.sum() + ent.sum()).backward(retain_graph=True)
        assert max(rows) <= chunk and len(rows) == applications
        assert torch.equal(hidden.grad, kept_grad[0]) and torch.equal(head.weight.grad, kept_grad[1])
        (lp.sum() + ent.sum()).backward()  # a second backward pass recomputes what the first one used
        assert len(rows) == applications + 5
        torch.testing.assert_close(hidden.grad, 2 * kept_grad[0])
    with torch.no_grad():
        rows.clear()
        token_stats_from_hidden(hidden, targets, head, 1.0, chunk)
    assert len(rows) == 5 and max(rows) <= chunk


def test_vocabulary_work_runs_a_block_of_rows_at_a_time(monkeypatch):
    """After each chunk's product, the float32 log-softmax (forward, and the backward's recomputation) sees at
    most a block of rows (BLOCK_BYTES of float32 logits), and every position exactly once per pass."""
    vocab, chunk = 101, 8
    monkeypatch.setattr(logprobs, "BLOCK_BYTES", 4 * vocab * 3)  # 3 rows a block
    head = torch.nn.Linear(12, vocab, bias=False)
    hidden = torch.randn(40, 12, requires_grad=True)
    targets = torch.randint(0, vocab, (40,))
    rows = []
    real = torch.log_softmax

    def spy(x, dim=None, **kwargs):
        rows.append(x.shape[0])
        return real(x, dim=dim, **kwargs)

    monkeypatch.setattr(torch, "log_softmax", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, ent = token_stats_from_hidden(hidden, targets, head, 1.0, chunk)
    assert max(rows) == 3 and sum(rows) == 40
    rows.clear()
    (lp.sum() + ent.sum()).backward()
    assert max(rows) == 3 and sum(rows) == 40
    # on an accelerator a chunk is one block: a launch per few rows would cost more than the cache saves
    assert logprobs._block_rows(torch.empty(8, vocab, device="meta")) == 8


def test_completion_logprobs_of_the_tiny_model(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    exps = [
        Experience([5, 6, 7], [8, 9, 10, 11], [0.0] * 4, 1.0, 0.5, 0, "stop", 0),
        Experience([12, 13], [14, 15], [0.0] * 2, 0.0, -0.5, 0, "length", 0),
    ]
    batch = collate(exps, pad_id=0)
    lp, ent = completion_logprobs(model, batch, temperature=0.9, chunk_size=3)
    for i, e in enumerate(exps):  # each sequence alone, unpadded, through the model's own logits
        ids = torch.tensor([e.prompt_ids + e.completion_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(e.prompt_ids) - 1: -1]
        want_lp, want_ent = plain_stats(logits, torch.tensor(e.completion_ids), 0.9)
        c = len(e.completion_ids)
        torch.testing.assert_close(lp[i, :c], want_lp.float(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ent[i, :c], want_ent.float(), rtol=1e-4, atol=1e-4)


def test_models_with_logit_postprocessing_use_their_own_logits(tiny_model):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    exps = [Experience([5, 6], [7, 8, 9], [0.0] * 3, 1.0, 0.5, 0, "stop", 0)]
    batch = collate(exps, pad_id=0)
    with torch.no_grad():
        before, _ = completion_logprobs(model, batch)
        model.config.final_logit_softcapping = 1.0  # a soft-cap the chunked path cannot apply
        original = model.forward
        calls = []

        def forward(*args, **kwargs):
            calls.append(kwargs.get("logits_to_keep"))
            out = original(*args, **kwargs)
            out.logits = torch.tanh(out.logits)  # what a soft-capped model returns
            return out

        model.forward = forward
        after, _ = completion_logprobs(model, batch)
    assert calls == [4]  # the model's own forward, keeping only the completion's logits
    logits = torch.tanh(original(input_ids=batch["input_ids"]).logits[0, 1:-1])
    want, _ = plain_stats(logits.detach(), batch["completion_ids"][0], 1.0)
    torch.testing.assert_close(after[0], want.float(), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(before, after)
