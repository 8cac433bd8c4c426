"""``model.update.skip_zero_advantage``: which sequences leave the backward pass, that the update stays the full
pass's for every loss that allows it, and the one-line refusals where it would not."""

from __future__ import annotations

import pytest
import torch

from rlflow import registry
from rlflow.config_error import ConfigError
from rlflow.data.experience import Experience
from rlflow.losses import LossContext
from rlflow.losses.base import PolicyLoss
from rlflow.training.zero_advantage import check_skip, even_out, split_minibatch, trains_nothing

LOSSES = ["grpo", "bnpo", "dr_grpo", "dapo", "gspo", "luspo", "cispo", "sapo", "vespo"]
MAX_TOKENS = 12


def experience(advantage: float, length: int = 4, truncated: bool = False, prompt: int = 3) -> Experience:
    return Experience(prompt_ids=list(range(prompt)), completion_ids=list(range(length)),
                      rollout_logprobs=[-1.0] * length, reward=0.0, advantage=advantage, group=0,
                      finish_reason="length" if truncated else "stop", policy_version=0)


def build(name: str, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    return registry.build("rlflow.losses", {"class_path": name, "init_args": kw})


# ----------------------------------------------------------------------------------------- the split
def test_zero_advantage_sequences_and_masked_truncations_are_forward_only():
    batch = [experience(1.0), experience(0.0), experience(-0.5, truncated=True), experience(0.0, truncated=True)]
    plain, masking = build("bnpo"), build("bnpo", mask_truncated_completions=True)
    assert [trains_nothing(e, plain) for e in batch] == [False, True, False, True]
    assert [trains_nothing(e, masking) for e in batch] == [False, True, True, True]
    trained, idle = split_minibatch(batch, masking)
    assert trained == [batch[0]] and idle == batch[1:]


def test_a_minibatch_that_trains_nothing_keeps_its_shortest_sequence_for_the_backward():
    batch = [experience(0.0, length=6), experience(0.0, length=2, prompt=5), experience(0.0, length=3, prompt=1)]
    trained, idle = split_minibatch(batch, build("grpo"))
    assert trained == [batch[2]] and idle == [batch[0], batch[1]]  # 4 tokens: shorter than 6 + 3 and 2 + 5


def test_a_rank_evens_out_its_passes_by_splitting_then_by_passes_that_change_nothing():
    """Under several processes every rank runs as many passes as the rank with the most."""
    a, b, c = experience(1.0), experience(-1.0), experience(0.5)
    assert even_out([[a, b, c]], 2) == [[a], [b, c]]  # split while it has the sequences
    assert even_out([[a], [b, c]], 4) == [[a], [b], [c], None]  # then a pass that changes nothing
    assert even_out([], 2) == [None, None]  # a rank with none of that kind
    assert even_out([[a, b]], 1) == [[a, b]]


# -------------------------------------------------------------------------------- the same gradient
def make_batch(n: int, t: int = 9, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    base = -torch.rand(n, t, generator=g) * 3.0
    adv = torch.randn(n, generator=g)
    adv[::3] = 0.0  # a third of the sequences: their group's rewards all agreed
    return dict(logp=base, old=base + 0.3 * torch.randn(n, t, generator=g), adv=adv, mask=mask,
                truncated=torch.tensor([i % 4 == 1 for i in range(n)]), is_w=0.5 + torch.rand(n, t, generator=g),
                rollout=base + 0.2 * torch.randn(n, t, generator=g), entropy=torch.rand(n, t, generator=g))


CASES = [(name, {}) for name in LOSSES] + [
    ("grpo", {"mask_truncated_completions": True}), ("dapo", {"off_policy_mask_threshold": 0.05}),
    ("bnpo", {"delta": 1.5, "clip_ratio_c": 3.0}), ("dr_grpo", {"importance_sampling_level": "sequence"}),
]


@pytest.mark.parametrize("name,kw", CASES)
def test_the_trained_sequences_alone_give_the_full_minibatchs_gradient(name, kw):
    """The mini-batch's gradient (one micro-batch of everything) against the trained sequences' micro-batches alone,
    each weighted by ``micro_batch_weight`` with the whole mini-batch's sizes: equal, for every built-in loss and
    normaliser, with rollout correction weights; and the left-out sequences' own gradient is exactly zero."""
    n = 12
    d = make_batch(n)
    loss_fn = build(name, **kw)
    assert loss_fn.zero_advantage_gradient() is None
    mask = d["mask"] & ~d["truncated"][:, None] if loss_fn.mask_truncated_completions else d["mask"]
    ctx = LossContext(mini_batch_sequences=n, mini_batch_tokens=int(mask.sum()), generation_batch_sequences=n,
                      generation_batch_tokens=int(mask.sum()), max_tokens=MAX_TOKENS)

    def grad_of(rows_list: list[list[int]]) -> torch.Tensor:
        logp = d["logp"].clone().requires_grad_(True)
        for rows in rows_list:
            idx = torch.tensor(rows)
            loss, _ = loss_fn(logp[idx], d["old"][idx], d["adv"][idx], d["mask"][idx],
                              rollout_logprobs=d["rollout"][idx], truncated=d["truncated"][idx],
                              rollout_is_weights=d["is_w"][idx], entropy=d["entropy"][idx], ctx=ctx)
            (loss * loss_fn.micro_batch_weight(mask[idx], ctx)).backward()
        return logp.grad

    full = grad_of([list(range(n))])
    batch = [experience(float(a), truncated=bool(tr)) for a, tr in zip(d["adv"], d["truncated"])]
    trained_rows = [i for i, e in enumerate(batch) if not trains_nothing(e, loss_fn)]
    idle_rows = [i for i in range(n) if i not in trained_rows]
    assert idle_rows and len(trained_rows) > 2
    torch.testing.assert_close(grad_of([trained_rows[:2], trained_rows[2:]]), full, rtol=1e-6, atol=1e-8)
    assert torch.equal(full[idle_rows], torch.zeros_like(full[idle_rows]))
    assert full[trained_rows].abs().sum() > 0


# ------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("kw,words", [
    ({"kl_coef": 0.05}, "kl_coef=0.05"),
    ({"entropy_coef": 0.01}, "entropy bonus"),
    ({"use_adaptive_entropy": True}, "entropy bonus"),
    ({"top_entropy_quantile": 0.2}, "top_entropy_quantile=0.2"),
])
def test_a_loss_term_with_a_gradient_at_zero_advantage_is_refused_in_one_line(kw, words):
    loss_fn = build("grpo", **kw)
    with pytest.raises(ConfigError) as err:
        check_skip(loss_fn, moe=False)
    line = str(err.value)
    assert "\n" not in line and words in line and "model.update.skip_zero_advantage" in line


def test_the_refused_terms_do_move_zero_advantage_sequences():
    """Why the refusals: with a KL term or an entropy bonus, a zero-advantage sequence's gradient is not zero."""
    d = make_batch(6)
    for kw in ({"kl_coef": 0.05}, {"entropy_coef": 0.01}):
        logp = d["logp"].clone().requires_grad_(True)
        entropy = d["entropy"].clone().requires_grad_(True)
        loss, _ = build("grpo", **kw)(logp, d["old"], d["adv"], d["mask"], ref_logprobs=d["rollout"],
                                      entropy=entropy, truncated=d["truncated"])
        loss.backward()
        moved = logp.grad[0].abs().sum() + (entropy.grad[0].abs().sum() if entropy.grad is not None else 0)
        assert d["adv"][0] == 0.0 and moved > 0


def test_a_plugin_loss_and_an_moe_policy_are_refused():
    class PluginLoss(PolicyLoss):
        def __call__(self, logprobs, old_logprobs, advantages, mask, **extra):
            return (logprobs * mask).sum(), {}

    for loss_fn, moe, words in [(PluginLoss(), False, "PluginLoss does not declare"),
                                (build("grpo"), True, "mixture of experts")]:
        with pytest.raises(ConfigError, match=words):
            check_skip(loss_fn, moe=moe)
    check_skip(build("cispo"), moe=False)  # allowed: nothing raised


def test_a_subclass_with_its_own_objective_must_declare_it():
    from rlflow.losses.surrogate import RatioPolicyLoss

    class Custom(RatioPolicyLoss):
        default_aggregation = "bnpo"

        def objective(self, coef, logprobs, adv, mask):
            return -coef * adv + 0.1 * logprobs, {}

    assert "does not declare" in Custom().zero_advantage_gradient()
