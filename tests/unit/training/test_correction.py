"""Rollout/training mismatch correction (TIS/MIS) against TRL's ``vllm_importance_sampling_*`` formulas."""


from __future__ import annotations

import pytest
import torch

from rlflow.training.correction import RolloutCorrection


def batch(seed=0, b=5, t=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    rollout = -torch.rand(b, t, generator=g) * 2
    old = rollout + 0.6 * torch.randn(b, t, generator=g)  # a visible mismatch, ratios on both sides of the cap
    return old, rollout, mask


def trl_ratio(old, rollout, mask, mode, cap):
    """TRL _generate_and_score_completions: diff masked, summed per sequence for sequence modes, exp, then cap."""
    diff = (old - rollout) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, max=cap)
    return ratio.masked_fill(ratio > cap, value=0.0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_weights_and_metrics_match_trl(mode):
    old, rollout, mask = batch(1)
    corr = RolloutCorrection(mode, cap=1.5)
    w = corr.weights(old, rollout, mask)
    expected = trl_ratio(old, rollout, mask, mode, 1.5)
    torch.testing.assert_close(w, expected)
    assert w.shape == ((5, 1) if mode.startswith("sequence") else (5, 7))
    if mode.endswith("mask"):
        assert (w == 0).any()  # the cap actually masked something
    else:
        assert w.max() == pytest.approx(1.5)
    metrics = corr.metrics(old, rollout, mask)
    delta = (old - rollout).abs()[mask]
    flat = expected.flatten() if mode.startswith("sequence") else expected[mask]
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(delta.mean().item())
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(delta.max().item())
    assert metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(flat.min().item())
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(flat.mean().item())
    assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(flat.max().item())


def test_mis_lower_bound_and_identical_engines():
    old, rollout, mask = batch(2)
    w = RolloutCorrection("token_mask", cap=2.0, min_ratio=0.5).weights(old, rollout, mask)
    ratio = torch.exp((old - rollout) * mask)
    keep = (ratio <= 2.0) & (ratio >= 0.5)
    torch.testing.assert_close(w, torch.where(keep, ratio, torch.zeros_like(ratio)))
    # the same engine on both sides: every weight is 1, every difference 0
    same = RolloutCorrection("sequence_truncate").metrics(rollout, rollout, mask)
    assert same["sampling/sampling_logp_difference/max"] == 0.0
    assert same["sampling/importance_sampling_ratio/min"] == same["sampling/importance_sampling_ratio/max"] == 1.0


def test_weights_multiply_the_policy_term_of_the_loss():
    from rlflow import registry

    old, rollout, mask = batch(3)
    logp = (old + 0.1).requires_grad_(True)
    adv = torch.tensor([1.0, -0.5, 0.3, -1.0, 0.7])
    w = RolloutCorrection("token_truncate", cap=2.0).weights(old, rollout, mask)
    loss_fn = registry.build("rlflow.losses", "bnpo")
    loss, _ = loss_fn(logp, old, adv, mask, rollout_is_weights=w)
    loss.backward()
    logp2 = (old + 0.1).requires_grad_(True)
    coef = torch.exp(logp2 - old)
    per_token = -torch.min(coef * adv[:, None], coef.clamp(0.8, 1.2) * adv[:, None]) * w
    expected = (per_token * mask).sum() / mask.sum()
    expected.backward()
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(logp.grad, logp2.grad)


def test_bad_settings_fail_clearly():
    with pytest.raises(ValueError, match="token_truncate, token_mask, sequence_truncate, sequence_mask"):
        RolloutCorrection("tis")
    with pytest.raises(ValueError, match="cap"):
        RolloutCorrection("token_mask", cap=0.0)
    with pytest.raises(ValueError, match="min_ratio"):
        RolloutCorrection("token_mask", cap=2.0, min_ratio=3.0)

