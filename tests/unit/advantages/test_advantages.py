"""Advantage estimators against loop-style re-implementations of the published formulas (TRL's GRPO advantages,
verl's ``compute_*_outcome_advantage`` with ``masked_whiten``), on random rewards, lengths and groups."""


from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from rlflow import registry
from rlflow.advantages import estimate

K = 4


def random_batch(seed=0, groups=5, k=K):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (groups * k,), generator=g).float() + 0.1 * torch.randn(groups * k, generator=g)
    rewards[:k] = 1.0  # one group whose rewards all agree
    lengths = torch.randint(1, 30, (groups * k,), generator=g).float()
    return rewards, lengths


def by_group(values, k):
    groups = defaultdict(list)
    for i, v in enumerate(values.tolist()):
        groups[i // k].append(v)
    return groups


def ref_grpo(rewards, k, scale):
    """TRL: (r - mean_group) / (std + 1e-4), std unbiased over the group, the batch, or no division."""
    groups = by_group(rewards, k)
    all_r = rewards.tolist()
    n = len(all_r)
    batch_mean = sum(all_r) / n
    batch_std = (sum((r - batch_mean) ** 2 for r in all_r) / (n - 1)) ** 0.5
    out = []
    for i, r in enumerate(all_r):
        grp = groups[i // k]
        mean = sum(grp) / k
        std = (sum((x - mean) ** 2 for x in grp) / (k - 1)) ** 0.5
        if scale == "group":
            out.append((r - mean) / (std + 1e-4))
        elif scale == "batch":
            out.append((r - mean) / (batch_std + 1e-4))
        else:
            out.append(r - mean)
    return torch.tensor(out)


def ref_rloo(rewards, k):
    """verl compute_rloo_outcome_advantage: r * n/(n-1) - mean * n/(n-1)."""
    groups = by_group(rewards, k)
    out = []
    for i, r in enumerate(rewards.tolist()):
        n = len(groups[i // k])
        mean = sum(groups[i // k]) / n
        out.append(r * n / (n - 1) - mean * n / (n - 1))
    return torch.tensor(out)


def ref_opo(rewards, lengths, k):
    """verl compute_opo_outcome_advantage: baseline sum(len * r) / sum(len) over the group."""
    gr, gl = by_group(rewards, k), by_group(lengths, k)
    out = []
    for i, r in enumerate(rewards.tolist()):
        rs, ls = gr[i // k], gl[i // k]
        out.append(r - sum(a * b for a, b in zip(rs, ls)) / sum(ls))
    return torch.tensor(out)


def ref_reinforce_pp(rewards, lengths, k, baseline):
    """verl: broadcast the (group-centred) score over the response tokens, then masked_whiten over all tokens."""
    scores = rewards.clone().double()
    if baseline:
        groups = by_group(rewards, k)
        scores = torch.tensor(
            [r - sum(groups[i // k]) / k for i, r in enumerate(rewards.tolist())], dtype=torch.float64
        )
    t = int(lengths.max())
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).double()
    values = scores.unsqueeze(1) * mask
    mean = (values * mask).sum() / mask.sum()
    var = (((values - mean) ** 2) * mask).sum() / mask.sum()
    var = var * mask.sum() / (mask.sum() - 1)  # masked_var(unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened[:, 0].float()  # every token of a completion has the same advantage


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grpo_matches_trl(scale):
    rewards, _ = random_batch(1)
    got = registry.build("rlflow.advantages", {"class_path": "grpo", "init_args": {"scale_rewards": scale}})(rewards, K)
    torch.testing.assert_close(got, ref_grpo(rewards, K, scale), rtol=1e-5, atol=1e-5)
    assert torch.all(got[:K] == 0)  # a group whose rewards agree has no signal


def test_dr_grpo_is_the_centred_reward():
    rewards, _ = random_batch(2)
    got = registry.build("rlflow.advantages", "dr_grpo")(rewards, K)
    torch.testing.assert_close(got, ref_grpo(rewards, K, "none"))


def test_rloo_matches_verl():
    rewards, _ = random_batch(3)
    got = registry.build("rlflow.advantages", "rloo")(rewards, K)
    torch.testing.assert_close(got, ref_rloo(rewards, K), rtol=1e-5, atol=1e-5)
    # the leave-one-out definition itself, for one completion
    r = rewards[K: 2 * K]
    assert got[K].item() == pytest.approx((r[0] - r[1:].mean()).item(), abs=1e-5)


def test_opo_matches_verl_and_needs_lengths():
    rewards, lengths = random_batch(4)
    est = registry.build("rlflow.advantages", "opo")
    torch.testing.assert_close(est(rewards, K, lengths=lengths), ref_opo(rewards, lengths, K), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(estimate(est, rewards, K, lengths), ref_opo(rewards, lengths, K), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="lengths"):
        est(rewards, K)


@pytest.mark.parametrize("baseline", [False, True])
def test_reinforce_pp_matches_verl_masked_whiten(baseline):
    rewards, lengths = random_batch(5)
    est = registry.build("rlflow.advantages", {"class_path": "reinforce_pp", "init_args": {"group_baseline": baseline}})
    got = estimate(est, rewards, K, lengths)
    torch.testing.assert_close(got, ref_reinforce_pp(rewards, lengths, K, baseline), rtol=1e-5, atol=1e-5)
    # whitened over tokens: the token-weighted mean is 0
    assert (got * lengths).sum().item() == pytest.approx(0.0, abs=1e-3)


def test_estimate_leaves_lengths_out_for_estimators_that_do_not_take_them():
    seen = []

    def plugin(rewards, group_size):
        seen.append(group_size)
        return rewards * 0

    rewards, lengths = random_batch(6)
    assert torch.all(estimate(plugin, rewards, K, lengths) == 0) and seen == [K]


def test_bad_layouts_fail_clearly():
    est = registry.build("rlflow.advantages", "grpo")
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        est(torch.zeros(8), 3)
    with pytest.raises(ValueError, match="at least 2"):
        registry.build("rlflow.advantages", "rloo")(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="3 lengths for 4 rewards"):
        registry.build("rlflow.advantages", "opo")(torch.zeros(4), 2, lengths=torch.ones(3))
    with pytest.raises(Exception, match="available: dr_grpo, gdpo, grpo, opo, reinforce_pp, rloo"):
        registry.build("rlflow.advantages", "gae")


# ------------------------------------------------------------------------------------------------ GDPO
def ref_gdpo(components, weights, k, eps=1e-4):
    """TRL's ``normalize_then_sum``, written with loops over plain lists (None: a judger gave no reward)."""
    n, judgers = len(components), len(weights)

    def stats(values):
        vals = [v for v in values if v is not None]
        if not vals:
            return None, None
        mean = sum(vals) / len(vals)
        std = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5 if len(vals) > 1 else None
        return mean, std

    summed = []
    for i in range(n):
        g = i // k
        total, any_scored = 0.0, False
        for j in range(judgers):
            v = components[i][j]
            if v is None:
                continue
            any_scored = True
            mean, std = stats([components[g * k + s][j] for s in range(k)])
            if std is not None:  # a NaN std (one value in the group) drops out of TRL's nansum
                total += weights[j] * (v - mean) / (std + eps)
        summed.append(total if any_scored else None)
    mean, std = stats(summed)
    return [0.0 if s is None else (s - mean) / (std + eps) for s in summed]


def test_gdpo_matches_trls_normalize_then_sum():
    """Two judgers of very different spreads (0/1 correctness, a 0.1-wide format score), weights 1 and 0.5, a judger
    that skipped some completions, one completion no judger scored, and a group where one judger is constant."""
    g = torch.Generator().manual_seed(3)
    n = 5 * K
    correct = torch.randint(0, 2, (n,), generator=g).float().tolist()
    fmt = (0.1 * torch.rand(n, generator=g)).tolist()
    components = [[c, f] for c, f in zip(correct, fmt)]
    components[1][1] = None  # the format judger failed on it
    components[6] = [None, None]  # no judger scored it
    for s in range(K):
        components[K * 3 + s][0] = 1.0  # group 3: every completion correct
    weights = [1.0, 0.5]
    comp = torch.tensor([[float("nan") if v is None else v for v in row] for row in components])
    got = registry.build("rlflow.advantages", "gdpo")(torch.zeros(n), K, components=comp, weights=torch.tensor(weights))
    torch.testing.assert_close(got, torch.tensor(ref_gdpo(components, weights, K)), rtol=1e-5, atol=1e-5)
    assert got[6] == 0.0
    # the format judger's group-normalised signal survives where GRPO's summed reward would be dominated
    grpo = registry.build("rlflow.advantages", "grpo")(torch.tensor([c + 0.5 * f for c, f in zip(correct, fmt)]), K)
    assert not torch.allclose(got, grpo, atol=1e-3)


def test_gdpo_through_estimate_needs_the_components():
    gdpo = registry.build("rlflow.advantages", "gdpo")
    comp = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    out = estimate(gdpo, torch.zeros(4), 2, components=(comp, torch.tensor([1.0, 1.0])))
    assert out.shape == (4,) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="needs each judger's rewards"):
        estimate(gdpo, torch.zeros(4), 2)

