"""rlflow.training.optim: bf16 weights lose AdamW's small updates (and the metric and warning say so), the bf16
optimizers keep them, and the LR schedule in optimizer steps."""


from __future__ import annotations

import importlib.util
import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from rlflow.config_error import ConfigError
from rlflow.training.optim import (
    LostUpdatesWarning,
    UpdateFraction,
    build_optimizer,
    check_optimizer,
    clip_grad_norm,
    fused_supported,
)

HAVE = {"adamw": True, "adamw_kahan": importlib.util.find_spec("optimi") is not None,
        "adamw_bf16_sr": importlib.util.find_spec("torchao") is not None}
NEEDS = {"adamw_kahan": "torch-optimi", "adamw_bf16_sr": "torchao"}


def needs(name: str):
    return pytest.mark.skipif(
        not HAVE[name], reason=f"{NEEDS.get(name)} is not installed: pip install 'rlflow[precision]'"
    )


def adamw_run(name: str, dtype: torch.dtype, steps: int, lr: float, n: int = 128, monitor: bool = False):
    """``steps`` AdamW steps on one ``[n, n]`` weight (init representable in bf16) with gradients that do not
    depend on the weights (a drift plus noise), so every run sees the same gradients.
    Returns the initial and final weights (float32) and, with ``monitor``, the per-step update fractions."""
    torch.manual_seed(0)
    w0 = (torch.randn(n, n) * 0.02).bfloat16().float()
    drift = torch.randn(n, n)
    p = torch.nn.Parameter(w0.to(dtype, copy=True))
    opt = build_optimizer(name, [p], lr=lr)
    fractions, exact = [], []
    um = UpdateFraction([p], name, sample_size=n * n)  # exact: one tensor, compared whole
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        p.grad = (drift + torch.randn(n, n, generator=gen)).to(dtype)
        before = p.detach().clone()
        if monitor:
            um.before_step()
        opt.step()
        if monitor:
            fractions.append(um.after_step())
            exact.append((p.detach() != before).float().mean().item())
    return w0, p.detach().float(), fractions, exact


# --------------------------------------------------------------------------------- (a) the finding
def test_bf16_weights_with_torch_adamw_lose_small_updates_and_the_metric_and_warning_say_so():
    with pytest.warns(LostUpdatesWarning, match="adamw_kahan or adamw_bf16_sr"):
        w0, w, fractions, exact = adamw_run("adamw", torch.bfloat16, steps=10, lr=1e-6, monitor=True)
    assert (w != w0).float().mean() < 0.1  # 10 steps at lr 1e-6 leave most bf16 weights as they were
    assert max(exact) < 0.1
    assert fractions == pytest.approx(exact, abs=1e-9)  # every element had a gradient here
    with warnings.catch_warnings():  # float32 master weights: every update lands, no warning
        warnings.simplefilter("error", LostUpdatesWarning)
        w0, w, fractions, exact = adamw_run("adamw", torch.float32, steps=10, lr=1e-6, monitor=True)
    assert (w != w0).float().mean() > 0.99 and min(fractions) > 0.99
    assert fractions == pytest.approx(exact, abs=1e-9)


# -------------------------------------------------------------------- (b) the bf16 optimizers keep them
@pytest.mark.parametrize("name", [pytest.param("adamw_kahan", marks=needs("adamw_kahan")),
                                  pytest.param("adamw_bf16_sr", marks=[needs("adamw_bf16_sr"), pytest.mark.slow])])
def test_bf16_optimizers_track_a_float32_adamw_run(name):
    """After 100 steps of lr 1e-5 (a total move of ~1e-3, each step below half a bf16 step of a 0.02 weight),
    the distance to torch's float32 AdamW relative to that move: ~0.9 for plain bf16 AdamW, far less here."""
    w0, ref, _, _ = adamw_run("adamw", torch.float32, steps=100, lr=1e-5)
    move = (ref - w0).abs().mean()
    _, plain, _, _ = adamw_run("adamw", torch.bfloat16, steps=100, lr=1e-5)
    _, kept, _, _ = adamw_run(name, torch.bfloat16, steps=100, lr=1e-5)
    plain_err, kept_err = (plain - ref).abs().mean() / move, (kept - ref).abs().mean() / move
    assert plain_err > 0.5, plain_err
    assert kept_err < 0.35 and kept_err < plain_err / 3, (kept_err, plain_err)


def test_unknown_or_missing_optimizer_is_one_clear_error(monkeypatch, tiny_model):
    with pytest.raises(ConfigError, match="adamw, adamw_bf16_sr, adamw_kahan"):
        check_optimizer("sgd")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "optimi" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install 'rlflow\[precision\]' \(or pip install torch-optimi\)"):
        check_optimizer("adamw_kahan")
    from rlflow.training.module import GRPOModule

    with pytest.raises(ConfigError, match="torch-optimi"):
        GRPOModule(model_path=str(tiny_model), optim={"optimizer": "adamw_kahan"})


# ---------------------------------------------------------------- (c) the metric against a recomputation
class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)  # rows of unused tokens get no gradient
        self.body = torch.nn.Linear(16, 300)  # 4800 weights: sampled when sample_size is small
        self.head = torch.nn.Linear(300, 50)

    def forward(self, ids):
        return self.head(torch.relu(self.body(self.emb(ids))))


@pytest.mark.parametrize("name", ["adamw", pytest.param("adamw_kahan", marks=needs("adamw_kahan"))])
def test_update_fraction_equals_a_plain_recomputation(name):
    torch.manual_seed(0)
    model = Small().to(torch.bfloat16)
    params = list(model.parameters())
    opt = build_optimizer(name, params, lr=1e-4)
    exact_um = UpdateFraction(params, name, sample_size=10**9)
    sampled_um = UpdateFraction(params, name, sample_size=512)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LostUpdatesWarning)
        for step in range(4):
            opt.zero_grad()
            model(torch.randint(0, 20, (8, 5))).float().logsumexp(-1).mean().backward()
            before = [p.detach().clone() for p in params]
            has_grad = [p.grad != 0 for p in params]  # read before step: optimi reuses .grad as scratch
            exact_um.before_step()
            sampled_um.before_step()
            opt.step()
            changed = sum(((p.detach() != b) & g).sum().item() for p, b, g in zip(params, before, has_grad))
            counted = sum(g.sum().item() for g in has_grad)
            expected = changed / counted
            assert counted < sum(p.numel() for p in params)  # the unused embedding rows are left out
            assert exact_um.after_step(step) == pytest.approx(expected, rel=1e-12)
            assert sampled_um.after_step(step) == pytest.approx(expected, abs=0.05)


# ------------------------------------------------------------------------ (e) the LR schedule, per optimizer step
def expected_factor(step: int, schedule: str, warmup: int, total: int) -> float:
    """The schedule written from its definition: warm-up (step + 1) / warmup, then 1, 1 - progress or
    0.5 * (1 + cos(pi * progress)), progress from 0 after warm-up to 1 at ``total`` optimizer steps."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return {"constant": 1.0, "linear": 1.0 - progress, "cosine": 0.5 * (1.0 + math.cos(math.pi * progress))}[schedule]


@pytest.mark.parametrize("optimizer_steps,num_iterations", [(1, 1), (4, 1), (4, 2)])
@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("optimizer", ["adamw", pytest.param("adamw_kahan", marks=needs("adamw_kahan")),
                                       pytest.param("adamw_bf16_sr", marks=needs("adamw_bf16_sr"))])
def test_lr_schedule_spans_the_rollout_steps_optimizer_steps(
    optimizer_steps, num_iterations, schedule, warmup, optimizer, tiny_model
):
    from rlflow.training.module import GRPOModule

    rollout_steps = 5
    module = GRPOModule(
        model_path=str(tiny_model),  # not loaded: the policy is set below
        optim={"lr": 2e-3, "lr_schedule": schedule, "warmup_steps": warmup, "optimizer": optimizer},
        update={"optimizer_steps": optimizer_steps, "num_iterations": num_iterations},
    )
    module.policy = torch.nn.Linear(4, 4)
    module._trainer = SimpleNamespace(estimated_stepping_batches=rollout_steps)  # counted in rollout steps
    config = module.configure_optimizers()
    opt, sched = config["optimizer"], config["lr_scheduler"]["scheduler"]
    total = rollout_steps * optimizer_steps * num_iterations
    for step in range(total + 2):  # two steps past the end: the schedule stays at its last value
        lr = float(opt.param_groups[0]["lr"])
        assert lr == pytest.approx(2e-3 * expected_factor(step, schedule, warmup, total), rel=1e-6, abs=1e-12), step
        opt.step()
        sched.step()


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_a_rebuilt_schedule_continues_as_a_run_of_the_new_length(schedule):
    """``rebuild_lr_scheduler`` (a run continued with a larger max_steps): from the step reached, the same learning
    rates and the same scheduler state as a run that had the new length from the start."""
    from rlflow.training.optim import build_lr_scheduler, rebuild_lr_scheduler

    def adamw():
        return torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)

    long_opt, short_opt = adamw(), adamw()
    long_sched = build_lr_scheduler(long_opt, schedule, 3, 20)
    short_sched = build_lr_scheduler(short_opt, schedule, 3, 8)
    for _ in range(8):
        long_opt.step()
        short_opt.step()
        long_sched.step()
        short_sched.step()
    assert short_opt.param_groups[0]["lr"] == 0.0  # the short schedule has ended
    resumed = rebuild_lr_scheduler(short_opt, schedule, 3, 20, short_sched.last_epoch)
    for step in range(8, 22):
        assert short_opt.param_groups[0]["lr"] == long_opt.param_groups[0]["lr"], step
        long_opt.step()
        short_opt.step()
        long_sched.step()
        resumed.step()
    assert resumed.state_dict() == long_sched.state_dict()


def test_adamw_takes_torchs_fused_kernel_where_the_parameters_allow_and_steps_as_the_formula():
    """``adamw`` on plain CPU tensors is the fused kernel (the Hugging Face Trainer's default); its steps are
    AdamW's formula, written out here in float64."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(7, 5)), torch.nn.Parameter(torch.randn(11))]
    lr, (b1, b2), wd, eps = 1e-2, (0.9, 0.99), 0.1, 1e-8
    opt = build_optimizer("adamw", params, lr, (b1, b2), wd)
    assert opt.defaults["fused"] is True
    start = [p.detach().double().clone() for p in params]
    m = [torch.zeros_like(s) for s in start]
    v = [torch.zeros_like(s) for s in start]
    for t in range(1, 4):
        grads = [torch.randn_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
        for i, g in enumerate(grads):
            g = g.double()
            start[i] *= 1 - lr * wd
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            start[i] -= lr * (m[i] / (1 - b1**t)) / ((v[i] / (1 - b2**t)).sqrt() + eps)
    for p, want in zip(params, start):
        assert torch.allclose(p.detach().double(), want, rtol=0, atol=1e-6)
    assert not fused_supported([torch.zeros(3, dtype=torch.long)])  # not floating point
    assert not fused_supported([torch.zeros(3, device="meta")])
    assert fused_supported([{"params": [torch.zeros(3)]}])  # parameter groups too


@pytest.mark.parametrize("scale", [1e-3, 1e3])
def test_gradient_clipping_gives_torchs_result_and_multiplies_only_gradients_over_the_max(scale, monkeypatch):
    """The norm and the gradients equal ``torch.nn.utils.clip_grad_norm_``'s bit for bit; under the max (a
    coefficient clamped to 1) no gradient is multiplied."""
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n, generator=gen)) for n in (7, 300, 1)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * scale
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for mine, theirs in zip(params, reference):
        theirs.grad = mine.grad.clone()
    want = torch.nn.utils.clip_grad_norm_(reference, 1.0)
    multiplied = []
    real = torch._foreach_mul_
    monkeypatch.setattr(torch, "_foreach_mul_", lambda *a, **k: multiplied.append(1) or real(*a, **k))
    got = clip_grad_norm(params, 1.0)
    assert torch.equal(got, want)
    assert all(torch.equal(mine.grad, theirs.grad) for mine, theirs in zip(params, reference))
    assert bool(multiplied) == (scale > 1)
    if scale > 1:
        assert float(torch.linalg.vector_norm(torch.cat([p.grad for p in params]))) == pytest.approx(1.0, rel=1e-5)
