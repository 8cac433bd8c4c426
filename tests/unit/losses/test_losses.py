"""Policy losses against plain re-implementations of the published formulas (TRL ``_compute_loss``,
``get_gamma_weights`` and ``get_off_policy_mask``, verl ``compute_policy_loss`` / ``kl_penalty``, the
CISPO/SAPO/GSPO/LUSPO/VESPO papers), gradients included, and micro-batch accumulation with ``micro_batch_weight``
against the full batch."""


from __future__ import annotations

import math

import pytest
import torch

from rlflow import registry
from rlflow.config_error import ConfigError
from rlflow.losses import LossContext, kl_penalty

B, T, MAX_TOKENS = 6, 9, 12


def make_batch(seed: int = 0, b: int = B, t: int = T):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t  # one full row
    mask = torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)
    base = -torch.rand(b, t, generator=g) * 3.0
    old = base + 0.35 * torch.randn(b, t, generator=g)  # ratios on both sides of the clip range
    ref = base + 0.25 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, generator=g).abs() * torch.tensor([1.0, -1.0]).repeat(b)[:b]  # both signs
    adv[1] = 0.0
    entropy = torch.rand(b, t, generator=g) * 2.0
    truncated = torch.tensor([i % 3 == 2 for i in range(b)])
    rollout_w = 0.5 + torch.rand(b, t, generator=g)
    return dict(logp=base, old=old, ref=ref, adv=adv, mask=mask, entropy=entropy, truncated=truncated, is_w=rollout_w)


# ------------------------------------------------------------------------------------ reference formulas
def ref_kl(logp, ref, kind):
    """verl ``kl_penalty`` / TRL's k3, written out."""
    if kind == "k1":
        return logp - ref
    if kind == "k2":
        return 0.5 * (logp - ref) ** 2
    if kind in ("k3", "low_var_kl"):
        kl = ref - logp
        return torch.exp(kl) - kl - 1
    if kind == "abs":
        return (logp - ref).abs()
    raise AssertionError(kind)


def ref_loss(d, logp, loss_type, *, eps_low=0.2, eps_high=0.2, level="token", delta=None, clip_c=None, beta=0.0,
             kl="k3", tau_pos=1.0, tau_neg=1.05, top_q=1.0, ent_coef=0.0, entropy=None, mask_trunc=False,
             is_w=None, agg=None, num_items=None, num_processes=1, kl_bias_correction=False, opsm=None,
             sampling=None, vespo=(2.0, 3.0, 3.0, 2.0)):
    """TRL's GRPOTrainer._compute_loss, re-typed from the formulas, with verl's dual clip and an entropy bonus."""
    mask = d["mask"].float()
    if mask_trunc:
        mask = mask * (~d["truncated"]).float().unsqueeze(1)
    adv = d["adv"].unsqueeze(1)
    if opsm is not None:  # TRL get_off_policy_mask: keep if A >= 0 or mean(sampling - logp) <= delta
        kl_div = torch.nan_to_num((sampling if sampling is not None else d["old"]) - logp.detach(), nan=0.0)
        avg_seq_kl = (kl_div * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1.0)
        off_policy_mask = ((adv >= 0) | (avg_seq_kl <= opsm)).float()
    log_ratio = logp - d["old"]
    token_log_ratio = log_ratio
    if level == "sequence":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_ratio)
    is_ratio = coef_1  # TRL multiplies the KL by coef_1 before the delta clamp
    if loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=1.0 + eps_high).detach() * adv * logp
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, torch.tensor(tau_pos), torch.tensor(tau_neg))
        per_token = -(torch.sigmoid(tau * (coef_1 - 1)) * 4.0 / tau) * adv
    elif loss_type == "vespo":  # TRL get_gamma_weights, under no_grad
        with torch.no_grad():
            k_pos, lambda_pos, k_neg, lambda_neg = vespo
            lower = math.log(1e-8)
            seq_log_ratio = torch.sum(torch.clamp(token_log_ratio, -20.0, 20.0) * mask, dim=-1, keepdim=True)
            if is_w is not None:
                seq_log_ratio += torch.sum(torch.clamp(torch.log(is_w), lower, 20.0), dim=-1, keepdim=True)
            log_w_seq = torch.clamp(seq_log_ratio, lower, 20.0)
            k_seq = torch.where(adv >= 0, k_pos, k_neg)
            lambda_seq = torch.where(adv >= 0, lambda_pos, lambda_neg).clamp(min=1e-4)
            phi_seq = torch.exp(lambda_seq + k_seq * log_w_seq - lambda_seq * torch.exp(log_w_seq))
            phi_seq = phi_seq.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        per_token = -phi_seq * adv * logp
        is_w = None  # folded into phi, not multiplied again
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token = -torch.min(coef_1 * adv, coef_2 * adv)
        if clip_c is not None:  # verl compute_policy_loss_vanilla
            pg3 = -adv * clip_c
            per_token = torch.where(adv < 0, torch.min(pg3, per_token), per_token)
    per_token = per_token.expand(mask.shape)
    if opsm is not None:
        per_token = per_token * off_policy_mask
    if top_q < 1.0:  # TRL get_high_entropy_mask
        ent = entropy.detach()
        threshold = torch.quantile(ent[mask.bool()], 1 - top_q)
        per_token = per_token * ((ent * mask >= threshold) & mask.bool()).float()
    if is_w is not None:
        per_token = per_token * is_w
    if beta:
        per_token = per_token + beta * ref_kl(logp, d["ref"], kl) * (is_ratio if kl_bias_correction else 1.0)
    if ent_coef:
        per_token = per_token - ent_coef * entropy
    agg = agg or {"grpo": "grpo", "gspo": "grpo", "sapo": "grpo", "bnpo": "bnpo", "dr_grpo": "dr_grpo",
                  "dapo": "dapo", "cispo": "dapo", "luspo": "luspo", "vespo": "dapo"}[loss_type]
    if agg == "luspo":
        return (per_token * mask).sum(-1).mean()
    if agg == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    if agg == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0)
    if agg == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * MAX_TOKENS)
    normalizer = (num_items if num_items is not None else mask.sum()) / num_processes
    return (per_token * mask).sum() / normalizer


def build(name, **kw):
    kw.setdefault("max_tokens", MAX_TOKENS)
    return registry.build("rlflow.losses", {"class_path": name, "init_args": kw})


def run_both(name, d, ref_kwargs, loss_kwargs, call_kwargs=None, ctx=None):
    """Loss and d(loss)/d(logp) (and d/d(entropy)) from rlflow and from the reference."""
    call_kwargs = dict(call_kwargs or {})
    logp = d["logp"].clone().requires_grad_(True)
    ent = d["entropy"].clone().requires_grad_(True)
    loss, metrics = build(name, **loss_kwargs)(
        logp, d["old"], d["adv"], d["mask"], ref_logprobs=d["ref"], entropy=ent, truncated=d["truncated"],
        ctx=ctx, **call_kwargs,
    )
    loss.backward()
    logp2 = d["logp"].clone().requires_grad_(True)
    ent2 = d["entropy"].clone().requires_grad_(True)
    expected = ref_loss(d, logp2, name, entropy=ent2, **ref_kwargs)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logp.grad, logp2.grad, rtol=1e-5, atol=1e-6)
    assert logp.grad.abs().sum() > 0
    if ent2.grad is not None:
        torch.testing.assert_close(ent.grad, ent2.grad, rtol=1e-5, atol=1e-6)
    return metrics


LOSSES = ["grpo", "bnpo", "dr_grpo", "dapo", "gspo", "luspo", "cispo", "sapo", "vespo"]


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_each_loss_matches_the_published_formula(name, level):
    d = make_batch(1)
    kw = {"importance_sampling_level": level} if name != "gspo" else {}
    ref_level = "sequence" if name == "gspo" else level
    eps = {"epsilon_low": 0.2, "epsilon_high": 0.28}
    if name == "vespo" and level == "sequence":  # its weight is built from token log-ratios: refused, not ignored
        with pytest.raises(ConfigError, match="importance_sampling_level must be 'token'"):
            build(name, **kw)
        return
    run_both(name, d, dict(eps_low=0.2, eps_high=0.28, level=ref_level), {**kw, **eps})


def test_luspo_defaults_to_the_sequence_ratio_and_weights_sequences_by_length():
    """LUSPO = GSPO's clipped sequence ratio with each sequence's loss summed, not averaged, over its tokens: on
    policy (ratio 1) the loss is ``-mean_i(A_i * len_i)``, worked out here from the lengths."""
    d = make_batch(2)
    run_both("luspo", d, dict(level="sequence"), {})
    lengths = d["mask"].sum(-1).float()
    loss, _ = build("luspo")(d["logp"], d["logp"].clone(), d["adv"], d["mask"])
    assert loss.item() == pytest.approx(-(d["adv"] * lengths).mean().item(), rel=1e-6)
    gspo, _ = build("gspo")(d["logp"], d["logp"].clone(), d["adv"], d["mask"])
    assert gspo.item() == pytest.approx(-d["adv"].mean().item(), rel=1e-6)  # the per-sequence mean it replaces


def test_vespo_weight_by_hand():
    """phi(w) = exp(lambda + k log w - lambda w): 1 at w = 1 (on-policy VESPO is REINFORCE), and at a sequence
    log-ratio of -0.5 spread over two tokens exp(3 - 1 - 3 e^-0.5) for a positive advantage (k 2, lambda 3),
    exp(2 - 1.5 - 2 e^-0.5) for a negative one (k 3, lambda 2)."""
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]])
    mask = torch.ones(2, 2, dtype=torch.bool)
    adv = torch.tensor([1.0, -1.0])
    loss_fn = build("vespo", aggregation="bnpo")
    loss, metrics = loss_fn(logp, logp.clone(), adv, mask)
    assert loss.item() == pytest.approx((-(1.0 * -3.0) - (-1.0 * -3.0)) / 4, abs=1e-6)  # phi = 1: -A * logp
    assert metrics["vespo/phi_seq_mean"] == pytest.approx(1.0)
    old = logp + 0.25  # each token's log-ratio -0.25: sequence log w = -0.5
    logp_g = logp.clone().requires_grad_(True)
    loss, metrics = loss_fn(logp_g, old, adv, mask)
    phi_pos = math.exp(3.0 - 2.0 * 0.5 - 3.0 * math.exp(-0.5))
    phi_neg = math.exp(2.0 - 3.0 * 0.5 - 2.0 * math.exp(-0.5))
    assert metrics["vespo/phi_seq_mean"] == pytest.approx((phi_pos + phi_neg) / 2, rel=1e-6)
    loss.backward()  # d/d logp of -phi * A * logp / 4 tokens: -phi * A / 4, phi held constant
    want = torch.tensor([[-phi_pos / 4] * 2, [phi_neg / 4] * 2])
    torch.testing.assert_close(logp_g.grad, want)


def test_vespo_folds_token_rollout_weights_into_the_sequence_weight():
    """TRL: for vespo the TIS/MIS weights enter log w (a masked-out token's weight 0 drives phi to ~0) and are not
    multiplied onto the loss again; sequence-level weights are refused with the fix named."""
    d = make_batch(5)
    d["is_w"] = torch.where(d["mask"], d["is_w"], 1.0)  # both TRL and rlflow weigh padding exp(0 * diff) = 1
    run_both("vespo", d, dict(is_w=d["is_w"]), {}, {"rollout_is_weights": d["is_w"]})
    masked = d["is_w"].clone()
    masked[0, 0] = 0.0  # token_mask dropped one token of sequence 0
    run_both("vespo", d, dict(is_w=masked), {}, {"rollout_is_weights": masked})
    logp = d["logp"].clone().requires_grad_(True)
    loss, _ = build("vespo")(logp, d["old"], d["adv"], d["mask"], rollout_is_weights=masked)
    loss.backward()
    assert logp.grad[0].abs().max() < 1e-12  # log w clamped at log(1e-8): phi ~ exp(-33), the sequence is out
    assert (logp.grad[2:].abs().sum(-1) > 0).all()  # the others still learn (row 1 has advantage 0)
    with pytest.raises(ConfigError, match="token_truncate or token_mask"):
        build("vespo")(d["logp"], d["old"], d["adv"], d["mask"], rollout_is_weights=d["is_w"][:, :1])


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl", "abs"])
def test_kl_estimators_and_their_gradients(kind):
    d = make_batch(2)
    logp = d["logp"].clone().requires_grad_(True)
    logp2 = d["logp"].clone().requires_grad_(True)
    got = kl_penalty(logp, d["ref"], kind)
    want = ref_kl(logp2, d["ref"], kind)
    torch.testing.assert_close(got, want)
    (got * d["mask"]).sum().backward()
    (want * d["mask"]).sum().backward()
    torch.testing.assert_close(logp.grad, logp2.grad)
    # and as the loss's KL term, with its metric
    metrics = run_both("bnpo", d, dict(beta=0.05, kl=kind), {"kl_coef": 0.05, "kl_type": kind})
    expected_kl = (ref_kl(d["logp"], d["ref"], kind) * d["mask"]).sum() / d["mask"].sum()
    assert metrics["kl"] == pytest.approx(expected_kl.item(), rel=1e-5)


@pytest.mark.parametrize("name, level", [("bnpo", "token"), ("grpo", "sequence"), ("gspo", "sequence"),
                                         ("cispo", "token"), ("sapo", "token")])
def test_the_bias_corrected_kl_against_trls_formula(name, level):
    """``use_bias_correction_kl``: TRL's ``per_token_kl * coef_1``, the ratio before any clamp, in the loss and
    in the logged ``kl``; differentiable, so on-policy (ratio exactly 1) the value is the same and the gradient
    is not."""
    d = make_batch(4)
    kw = {"importance_sampling_level": level} if name != "gspo" else {}
    ref_kw = dict(beta=0.1, kl="k3", kl_bias_correction=True, level=level)
    metrics = run_both(name, d, ref_kw, {**kw, "kl_coef": 0.1, "use_bias_correction_kl": True})
    log_ratio = d["logp"] - d["old"]
    m = d["mask"].float()
    if level == "sequence":
        log_ratio = ((log_ratio * m).sum(-1) / m.sum(-1)).unsqueeze(-1)
    expected_kl = (ref_kl(d["logp"], d["ref"], "k3") * torch.exp(log_ratio) * m).sum() / m.sum()
    assert metrics["kl"] == pytest.approx(expected_kl.item(), rel=1e-5)

    on_policy = dict(d, old=d["logp"].clone())
    grads = []
    for corrected in (False, True):
        logp = d["logp"].clone().requires_grad_(True)
        loss, _ = build(name, **kw, kl_coef=0.1, use_bias_correction_kl=corrected)(
            logp, on_policy["old"], d["adv"], d["mask"], ref_logprobs=d["ref"], entropy=d["entropy"])
        loss.backward()
        grads.append((loss.detach(), logp.grad))
        run_both(name, on_policy, dict(ref_kw, kl_bias_correction=corrected),
                 {**kw, "kl_coef": 0.1, "use_bias_correction_kl": corrected})
    torch.testing.assert_close(grads[0][0], grads[1][0])
    assert not torch.allclose(grads[0][1], grads[1][1])


def test_k3_is_clamped_like_verl_low_var_kl():
    logp = torch.tensor([0.0, -40.0, 40.0])
    ref = torch.zeros(3)
    out = kl_penalty(logp, ref, "k3")
    assert out[0] == 0.0
    assert out[1] == pytest.approx(10.0) and out[2] == pytest.approx(10.0)  # the result is clamped to 10
    inner = kl_penalty(torch.tensor([3.0]), torch.zeros(1), "low_var_kl")  # inside the bounds: TRL's k3
    assert inner.item() == pytest.approx(math.exp(-3.0) + 3.0 - 1.0)


@pytest.mark.parametrize("name", ["grpo", "dapo"])
def test_delta_and_dual_clip(name):
    d = make_batch(3)
    # large ratios: delta and the dual clip bite
    d["old"] = d["logp"] - 1.2 * torch.rand(B, T, generator=torch.Generator().manual_seed(3))
    run_both(name, d, dict(delta=1.5), {"delta": 1.5})
    metrics = run_both(name, d, dict(clip_c=2.0), {"clip_ratio_c": 2.0})
    coef = torch.exp(d["logp"] - d["old"])
    adv = d["adv"].unsqueeze(1)
    base = -torch.min(coef * adv, coef.clamp(0.8, 1.2) * adv)
    dual = ((base > -adv * 2.0) & (adv < 0)).float()
    assert metrics["clip_ratio/dual_mean"] == pytest.approx(((dual * d["mask"]).sum() / d["mask"].sum()).item())
    assert metrics["clip_ratio/dual_mean"] > 0  # the case is actually exercised


def test_options_truncation_entropy_mask_bonus_and_rollout_weights():
    d = make_batch(4)
    run_both("grpo", d, dict(mask_trunc=True), {"mask_truncated_completions": True})
    run_both("dapo", d, dict(top_q=0.3), {"top_entropy_quantile": 0.3})
    run_both("bnpo", d, dict(ent_coef=0.01), {"entropy_coef": 0.01})
    run_both("cispo", d, dict(is_w=d["is_w"]), {}, {"rollout_is_weights": d["is_w"]})
    run_both("sapo", d, dict(tau_pos=0.5, tau_neg=2.0, agg="bnpo"),
             {"tau_pos": 0.5, "tau_neg": 2.0, "aggregation": "bnpo"})


@pytest.mark.parametrize("name", ["grpo", "dapo", "cispo", "sapo", "vespo"])
def test_off_policy_sequence_masking_against_trls_formula(name):
    """``off_policy_mask_threshold`` (DeepSeek-V3.2 eq. 9, TRL's ``get_off_policy_mask``): a negative-advantage
    completion whose mean ``sampler - current`` log-prob exceeds the threshold leaves the loss (KL term kept); the
    sampler is the rollout engine when its log-probs are given, else ``old_logprobs``; the dropped share is logged."""
    d = make_batch(9)
    d["old"] = d["logp"] + 0.4 * torch.rand(B, T, generator=torch.Generator().manual_seed(1))  # drift in [0, 0.4]
    m = d["mask"].float()
    for sampling in (None, d["old"] + 0.3):
        call = {} if sampling is None else {"rollout_logprobs": sampling}
        threshold = 0.2 if sampling is None else 0.5
        metrics = run_both(name, d, dict(opsm=threshold, sampling=sampling, beta=0.05),
                           {"off_policy_mask_threshold": threshold, "kl_coef": 0.05}, call)
        drift = (((d["old"] if sampling is None else sampling) - d["logp"]) * m).sum(-1) / m.sum(-1)
        dropped = (d["adv"] < 0) & (drift > threshold)
        if sampling is None:  # the case really drops some negative-advantage completions and keeps others
            assert 0 < int(dropped.sum()) < int((d["adv"] < 0).sum())
        assert metrics["off_policy_mask/dropped_ratio"] == pytest.approx(dropped.float().mean().item())
    # dropped sequences get no policy gradient; a threshold nothing exceeds changes nothing
    logp = d["logp"].clone().requires_grad_(True)
    build(name, off_policy_mask_threshold=0.2)(logp, d["old"], d["adv"], d["mask"])[0].backward()
    drift = ((d["old"] - d["logp"]) * m).sum(-1) / m.sum(-1)
    dropped = (d["adv"] < 0) & (drift > 0.2)
    assert torch.all(logp.grad[dropped] == 0) and logp.grad[~dropped].abs().sum() > 0
    loose, _ = build(name, off_policy_mask_threshold=10.0)(d["logp"], d["old"], d["adv"], d["mask"])
    plain, _ = build(name)(d["logp"], d["old"], d["adv"], d["mask"])
    torch.testing.assert_close(loose, plain)


def test_clip_metrics_use_trl_definitions():
    d = make_batch(5)
    _, metrics = build("bnpo", epsilon_low=0.2, epsilon_high=0.28)(d["logp"], d["old"], d["adv"], d["mask"])
    coef = torch.exp(d["logp"] - d["old"])
    adv = d["adv"].unsqueeze(1)
    m = d["mask"].float()
    low = ((coef < 0.8) & (adv < 0)).float()
    high = ((coef > 1.28) & (adv > 0)).float()
    assert metrics["clip_ratio/low_mean"] == pytest.approx(((low * m).sum() / m.sum()).item())
    assert metrics["clip_ratio/high_mean"] == pytest.approx(((high * m).sum() / m.sum()).item())
    assert metrics["clip_ratio/region_mean"] == pytest.approx((((low + high).clamp(max=1) * m).sum() / m.sum()).item())
    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
    # sequence level: one flag per sequence, averaged over sequences
    _, seq = build("gspo", epsilon_low=0.1, epsilon_high=0.1)(d["logp"], d["old"], d["adv"], d["mask"])
    lr = ((d["logp"] - d["old"]) * m).sum(-1) / m.sum(-1)
    flags = ((lr.exp() < 0.9) & (d["adv"] < 0)).float()
    assert seq["clip_ratio/low_mean"] == pytest.approx(flags.mean().item())
    _, cis = build("cispo", epsilon_high=0.1)(d["logp"], d["old"], d["adv"], d["mask"])
    assert cis["cispo_clip_ratio"] == pytest.approx(((((coef > 1.1) & (adv > 0)).float() * m).sum() / m.sum()).item())


def test_dapo_normalises_by_the_generation_batch_across_ranks():
    d = make_batch(6)
    ctx = LossContext(mini_batch_sequences=B, mini_batch_tokens=int(d["mask"].sum()), generation_batch_sequences=4 * B,
                      generation_batch_tokens=200, max_tokens=MAX_TOKENS, world_size=2)
    run_both("dapo", d, dict(num_items=200, num_processes=2), {}, ctx=ctx)


# ----------------------------------------------------------------------------- micro-batch accumulation
ACCUMULATION = [
    ("grpo", {}), ("bnpo", {}), ("dr_grpo", {}), ("dapo", {}), ("gspo", {}), ("luspo", {}), ("cispo", {}),
    ("sapo", {}), ("vespo", {}), ("grpo", {"off_policy_mask_threshold": 0.05}),
    ("bnpo", {"mask_truncated_completions": True}), ("dapo", {"kl_coef": 0.1}),
]


def _ctx(mask, rows, world, gen_tokens):
    return LossContext(
        mini_batch_sequences=len(rows), mini_batch_tokens=int(mask[rows].sum()),
        generation_batch_sequences=len(rows), generation_batch_tokens=gen_tokens, max_tokens=MAX_TOKENS,
        world_size=world,
    )


@pytest.mark.parametrize("name,kw", ACCUMULATION)
@pytest.mark.parametrize("world", [1, 2])
def test_micro_batches_accumulate_to_the_full_batch_gradient(name, kw, world):
    """Each rank sums ``micro_batch_weight * loss`` over uneven micro-batches; DDP averages the ranks' gradients.
    That must equal the gradient of the loss computed over every rank's mini-batch at once."""
    n = 10
    d = make_batch(7, b=n)
    loss_fn = build(name, **kw)
    mask = d["mask"]
    if loss_fn.mask_truncated_completions:
        mask = mask & ~d["truncated"].unsqueeze(1)
    gen_tokens = int(mask.sum()) * 2  # the generation batch also feeds a second optimizer step
    everything = list(range(n))
    full_ctx = _ctx(mask, everything, 1, gen_tokens)
    logp = d["logp"].clone().requires_grad_(True)
    loss, _ = loss_fn(
        logp, d["old"], d["adv"], d["mask"], ref_logprobs=d["ref"], truncated=d["truncated"], ctx=full_ctx
    )
    (loss * loss_fn.micro_batch_weight(mask, full_ctx)).backward()
    assert loss_fn.micro_batch_weight(mask, full_ctx) == pytest.approx(1.0)
    full_grad = logp.grad.clone()

    ranks = [everything[: n // world * (r + 1)][n // world * r:] for r in range(world)] if world > 1 else [everything]
    summed = torch.zeros_like(full_grad)
    ctx = LossContext(  # sizes summed over ranks, as GRPOModule.global_counts makes them
        mini_batch_sequences=n, mini_batch_tokens=int(mask.sum()), generation_batch_sequences=n,
        generation_batch_tokens=gen_tokens, max_tokens=MAX_TOKENS, world_size=world,
    )
    for rows in ranks:
        logp_r = d["logp"].clone().requires_grad_(True)
        cuts = [0, 2, 3, len(rows)]  # micro-batches of 2, 1 and the rest
        for a, b in zip(cuts, cuts[1:]):
            idx = torch.tensor(rows[a:b])
            sel = {k: v[idx] for k, v in d.items()}
            micro_mask = mask[idx]
            l, _ = loss_fn(logp_r[idx], sel["old"], sel["adv"], sel["mask"], ref_logprobs=sel["ref"],
                           truncated=sel["truncated"], ctx=ctx)
            (l * loss_fn.micro_batch_weight(micro_mask, ctx)).backward()
        summed += logp_r.grad
    torch.testing.assert_close(summed / world, full_grad, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------- errors
def test_bad_options_fail_clearly():
    with pytest.raises(Exception, match="kl_type"):
        build("grpo", kl_type="k4")
    with pytest.raises(Exception, match="importance_sampling_level"):
        build("grpo", importance_sampling_level="segment")
    with pytest.raises(Exception, match="delta"):
        build("grpo", delta=1.1)
    with pytest.raises(Exception, match="clip_ratio_c"):
        build("dapo", clip_ratio_c=0.5)
    with pytest.raises(Exception, match="aggregation"):
        build("cispo", aggregation="sum")
    with pytest.raises(Exception, match="off_policy_mask_threshold"):
        build("grpo", off_policy_mask_threshold=-0.1)
    with pytest.raises(Exception, match="lambda"):
        build("vespo", lambda_neg=0.0)
    with pytest.raises(Exception, match="available: bnpo, cispo, dapo, dr_grpo, grpo, gspo, luspo, sapo, vespo"):
        registry.build("rlflow.losses", "ppo")
    d = make_batch(8)
    with pytest.raises(ValueError, match="ref_logprobs"):
        build("grpo", kl_coef=0.1)(d["logp"], d["old"], d["adv"], d["mask"])
    with pytest.raises(ValueError, match="truncated"):
        build("grpo", mask_truncated_completions=True)(d["logp"], d["old"], d["adv"], d["mask"])
    with pytest.raises(ValueError, match="entropy"):
        build("grpo", top_entropy_quantile=0.5)(d["logp"], d["old"], d["adv"], d["mask"])


# ---------------------------------------------------------------------------------- adaptive entropy control
def test_adaptive_entropy_follows_skywork_or1s_rule_step_by_step():
    """Worked by hand (target 1.0, delta 0.01, bounds [0, 0.025], start 0.01): a step's bonus uses the coefficient
    from the end of the step before, gated by the entropy measured then (none on step 1: nothing measured), and the
    coefficient moves up after a step at or below the target, down after one above, within its bounds."""
    d = make_batch(11)
    loss_fn = build("bnpo", use_adaptive_entropy=True, entropy_coef=0.01, entropy_target=1.0, entropy_coef_delta=0.01,
                    entropy_coef_max=0.025)
    m = d["mask"]
    applied, coefs = [], []
    for level in (0.5, 2.0, 0.5, 0.5):  # the batch's entropy each step (constant over its tokens)
        ent = torch.full((B, T), level)
        loss, _ = loss_fn(d["logp"], d["old"], d["adv"], m, entropy=ent)
        base = ref_loss(d, d["logp"], "bnpo", entropy=ent)
        applied.append(round((base - loss).item() / level, 6))  # bnpo: the bonus is coef * the token mean = coef*level
        coefs.append(loss_fn.on_optimizer_step()["entropy_coef"])
    assert applied == [0.0, 0.02, 0.0, 0.02]
    assert coefs == pytest.approx([0.02, 0.01, 0.02, 0.025])
    assert loss_fn.state_dict() == {"adaptive_entropy": {"entropy_coef": pytest.approx(0.025), "last_entropy": 0.5}}


def test_adaptive_entropy_measures_every_micro_batch_and_rank_and_can_resume():
    """The step's entropy is the token-weighted mean over its micro-batches and over ranks (``reduce_sum``), over
    the tokens the loss trains on; a skipped step leaves the controller as it was; the state reloads."""
    d = make_batch(12)
    loss_fn = build("grpo", use_adaptive_entropy=True, entropy_coef=0.0, entropy_target=1.0,
                    mask_truncated_completions=True)
    trained = d["mask"] & ~d["truncated"].unsqueeze(1)
    halves = [slice(0, 2), slice(2, B)]
    for part in halves:
        loss_fn(d["logp"][part], d["old"][part], d["adv"][part], d["mask"][part], entropy=d["entropy"][part],
                truncated=d["truncated"][part])
    other_rank = torch.tensor([30.0, 20.0], dtype=torch.float64)  # another rank's entropy sum and token count
    loss_fn.on_optimizer_step(lambda t: t + other_rank)
    mine = (d["entropy"] * trained).sum().item()
    want = (mine + 30.0) / (trained.sum().item() + 20.0)
    assert loss_fn.adaptive_entropy.last_entropy == pytest.approx(want, rel=1e-6)
    state = loss_fn.state_dict()
    loss_fn(d["logp"], d["old"], d["adv"], d["mask"], entropy=d["entropy"] * 0, truncated=d["truncated"])
    loss_fn.on_skipped_step()
    assert loss_fn.state_dict() == state
    fresh = build("grpo", use_adaptive_entropy=True, entropy_coef=0.0, entropy_target=1.0)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    with pytest.raises(ConfigError, match="entropy_coef_min <= entropy_coef <= entropy_coef_max"):
        build("grpo", use_adaptive_entropy=True, entropy_coef=2.0)
    with pytest.raises(ValueError, match="use_adaptive_entropy needs the per-token 'entropy'"):
        build("grpo", use_adaptive_entropy=True)(d["logp"], d["old"], d["adv"], d["mask"])

