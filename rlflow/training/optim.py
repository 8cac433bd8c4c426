"""The optimizer, the learning-rate schedule, and a check that optimizer steps actually change the weights.

``model.optim.optimizer`` picks the AdamW implementation:

- ``adamw``: ``torch.optim.AdamW``, its fused kernel where the parameters allow (:func:`fused_supported`). Right
  for float32 parameters (``model.policy.dtype: float32``, with
  ``trainer.precision: bf16-mixed`` or an FSDP2 ``param_dtype: bfloat16`` for bf16 compute). On bfloat16
  parameters it loses small updates: bf16 keeps 8 significant bits, so a weight of 1e-2 moves only in steps of
  about 6e-5, and an update of lr 1e-6 is rounded away.
- ``adamw_bf16_sr``: torchao's AdamW (``torchao.optim._AdamW``, torchao >= 0.10; the class torchao's low-bit
  optimizers share, exported under that name) with ``bf16_stochastic_round=True``: the step is computed in
  float32 and rounded to bf16 up or down at random in proportion, so small updates survive in expectation.
  Its step is ``torch.compile``d per parameter shape (on CPU that needs a C++ compiler and tens of seconds).
- ``adamw_kahan``: torch-optimi's ``optimi.AdamW(kahan_sum=True)``: a bf16 compensation buffer per parameter
  carries what rounding dropped into the next step. Its moment buffers are kept in the parameter dtype.

The two bf16 optimizers need ``pip install 'rlflow[precision]'``. The schedule is torch's: linear warm-up
(``LinearLR``) then constant, linear decay or cosine decay, chained with ``SequentialLR``, counted in optimizer
steps. :class:`UpdateFraction` measures ``optim/update_fraction``, the share of the parameters with a gradient
that an optimizer step changed, and warns when most updates are lost.

Simplifications: all three use the same hyper-parameters (torch's ``eps`` 1e-8; no separate weight-decay
groups); the update fraction is estimated from a fixed random sample of elements in large tensors (exact for
small ones), per rank on its own shards under FSDP2, and counts changes of the stored values, so with
``adamw_bf16_sr`` and ``adamw_kahan`` it is low by design (they keep small updates in expectation or in the
compensation buffer, not in every stored bf16 value) and it warns only for ``adamw``.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from collections.abc import Iterable

import torch
from torch.optim import lr_scheduler

from rlflow.config_error import ConfigError

#: ``model.optim.optimizer`` values -> (module, pip package) they need, ``None`` for torch's own.
OPTIMIZERS: dict[str, tuple[str, str] | None] = {
    "adamw": None,
    "adamw_bf16_sr": ("torchao", "torchao"),
    "adamw_kahan": ("optimi", "torch-optimi"),
}
SCHEDULES = ("constant", "linear", "cosine")
LOW_PRECISION = (torch.bfloat16, torch.float16)


class LostUpdatesWarning(UserWarning):
    """Most of an optimizer step's updates were rounded away (low-precision parameters with plain AdamW)."""


def check_optimizer(name: str) -> None:
    """Refuse an unknown ``model.optim.optimizer``, or one whose package is missing, before any model is loaded."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"model.optim.optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
    need = OPTIMIZERS[name]
    if need is not None and importlib.util.find_spec(need[0]) is None:
        raise ConfigError(f"model.optim.optimizer={name} needs the {need[1]} package: pip install 'rlflow[precision]' "
                          f"(or pip install {need[1]})")


def build_optimizer(
    name: str, params: Iterable[torch.nn.Parameter], lr: float, betas: tuple[float, float] = (0.9, 0.999),
    weight_decay: float = 0.0, eps: float = 1e-8,
) -> torch.optim.Optimizer:
    """The AdamW of ``model.optim.optimizer`` (see the module docstring) over ``params``."""
    check_optimizer(name)
    kwargs = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, eps=eps)
    if name == "adamw_bf16_sr":
        return importlib.import_module("torchao.optim")._AdamW(params, bf16_stochastic_round=True, **kwargs)
    if name == "adamw_kahan":
        return importlib.import_module("optimi").AdamW(params, kahan_sum=True, **kwargs)
    params = list(params)
    return torch.optim.AdamW(params, fused=fused_supported(params) or None, **kwargs)


def fused_supported(params: list) -> bool:
    """Whether torch's fused AdamW kernel takes ``params`` (plain floating-point tensors on a CPU or CUDA device;
    not FSDP2's DTensor shards, which keep the default multi-tensor step). Fused is what the Hugging Face Trainer
    (and so TRL) uses by default with torch >= 2.8: one kernel per step instead of a dozen multi-tensor ops (the
    demo's 0.3M parameters: 0.5 ms against 2.9 ms per step on two CPU threads)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a torch built without distributed
        DTensor = ()  # noqa: N806 - no DTensor exists then
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]  # tensors or groups
    return bool(tensors) and all(not isinstance(t, DTensor) and t.is_floating_point()
                                 and t.device.type in ("cpu", "cuda") for t in tensors)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm)``, with the same result bit for bit; on a CPU, where the
    norm is on the host and reading it costs nothing, the gradients are multiplied only when the coefficient
    ``max_norm / (norm + 1e-6)`` is below 1 (torch clamps it to 1 and multiplies every gradient by it anyway, so
    that a GPU need not wait for the norm: a pass over every gradient that changes no bit)."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or grads[0].device.type != "cpu":
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    norm = torch.nn.utils.get_total_norm(grads)
    if bool(max_norm / (norm + 1e-6) < 1.0):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, total_steps: int
) -> lr_scheduler.LRScheduler:
    """torch's schedulers for: factor ``(step + 1) / warmup_steps`` during warm-up, then ``constant`` (1),
    ``linear`` (``1 - progress``) or ``cosine`` (``0.5 * (1 + cos(pi * progress))``), ``progress`` going from 0
    after warm-up to 1 at ``total_steps`` (and staying there); ``step`` counts optimizer steps from 0."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"model.optim.lr_schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    decay = max(total_steps - warmup_steps, 1)
    schedulers: list[lr_scheduler.LRScheduler] = []
    milestones: list[int] = []
    if warmup_steps > 0:
        schedulers.append(lr_scheduler.LinearLR(optimizer, start_factor=1.0 / warmup_steps, end_factor=1.0,
                                                total_iters=max(warmup_steps - 1, 1)))
        milestones.append(warmup_steps)
    if schedule == "constant":
        schedulers.append(lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0))
    elif schedule == "linear":  # LinearLR stays at its end factor after total_iters
        schedulers.append(lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=0.0, total_iters=decay))
    else:  # cosine, then 0 (CosineAnnealingLR alone would rise again after T_max)
        schedulers.append(lr_scheduler.CosineAnnealingLR(optimizer, T_max=decay))
        schedulers.append(lr_scheduler.ConstantLR(optimizer, factor=0.0, total_iters=1 << 62))
        milestones.append(warmup_steps + decay)
    if len(schedulers) == 1:
        return schedulers[0]
    return lr_scheduler.SequentialLR(optimizer, schedulers, milestones=milestones)


def rebuild_lr_scheduler(
    optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, total_steps: int, steps_taken: int
) -> lr_scheduler.LRScheduler:
    """:func:`build_lr_scheduler` for ``total_steps``, advanced by ``steps_taken`` optimizer steps, the optimizer's
    learning rate set to the schedule's value there: what a run of ``total_steps`` has after as many steps (the same
    floats, since torch's schedulers compute each value from the previous one).

    A run continued with a larger ``max_steps`` uses it: the checkpoint's scheduler ends at the old ``max_steps``
    (a linear or cosine decay would stay at 0 for every added step)."""
    for group in optimizer.param_groups:
        group["lr"] = group["initial_lr"]  # as when build_lr_scheduler first ran, on the fresh optimizer
    scheduler = build_lr_scheduler(optimizer, schedule, warmup_steps, total_steps)
    with warnings.catch_warnings():  # no optimizer step was taken in this process yet: torch would warn
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
        for _ in range(steps_taken):
            scheduler.step()
    return scheduler


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor itself, flattened."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.detach().reshape(-1)


class UpdateFraction:
    """``optim/update_fraction``: the share of parameter elements with a non-zero gradient whose stored value
    an optimizer step changed; 1.0 when updates land, far below when rounding swallows them.

    Call :meth:`before_step` just before ``optimizer.step()`` and :meth:`after_step` just after. Tensors of at
    most ``sample_size`` elements are compared whole; larger ones at a fixed sample of ``sample_size`` positions
    (seeded, drawn once), each tensor weighted by its size. For
    Qwen3-8B (~400 tensors) that is ~1.6M elements a step, a few small gathers. Warns once (rank zero) when the
    fraction falls below ``warn_below`` with plain ``adamw`` on bf16/fp16 parameters.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], optimizer: str = "adamw", sample_size: int = 4096,
                 seed: int = 0, warn_below: float = 0.5) -> None:
        self.params = list(params)
        self.sample_size, self.seed, self.warn_below = sample_size, seed, warn_below
        low = any(p.dtype in LOW_PRECISION for p in self.params)
        self.may_warn = optimizer == "adamw" and low
        self.warned = False
        self._index: dict[int, torch.Tensor | None] = {}
        self._before: list[tuple[torch.Tensor, torch.Tensor] | None] = []

    def _sample(self, i: int, flat: torch.Tensor) -> torch.Tensor:
        if i not in self._index:
            n = flat.numel()
            if n <= self.sample_size:
                self._index[i] = None
            else:
                gen = torch.Generator().manual_seed(self.seed + i)
                self._index[i] = torch.randint(n, (self.sample_size,), generator=gen, device="cpu").to(flat.device)
        index = self._index[i]
        return flat.clone() if index is None else flat.index_select(0, index)

    @torch.no_grad()
    def before_step(self) -> None:
        """Sample the values and which of them have a gradient (read now: some optimizers reuse ``.grad``)."""
        self._before = [
            None if p.grad is None else (self._sample(i, _local(p)), self._sample(i, _local(p.grad)) != 0)
            for i, p in enumerate(self.params)
        ]

    @torch.no_grad()
    def after_step(self, step: int | None = None) -> float | None:
        """The fraction for the step since :meth:`before_step`; None when no sampled element had a gradient."""
        totals = []
        for i, (p, before) in enumerate(zip(self.params, self._before)):
            if before is None or before[0].numel() == 0:
                continue
            values, has_grad = before
            flat = _local(p)
            changed = has_grad & (self._sample(i, flat) != values)
            scale = flat.numel() / values.numel()
            totals.append(torch.stack([changed.sum(), has_grad.sum()]).cpu().double() * scale)
        self._before = []
        if not totals:
            return None
        changed, counted = torch.stack(totals).sum(0).tolist()
        if counted == 0:
            return None
        fraction = changed / counted
        if self.may_warn and not self.warned and fraction < self.warn_below:
            self.warn(fraction, step)
        return fraction

    def warn(self, fraction: float, step: int | None) -> None:
        from lightning.pytorch.utilities import rank_zero_warn

        self.warned = True
        where = f"optimizer step {step}" if step is not None else "an optimizer step"
        rank_zero_warn(
            f"[rlflow] {where} changed only {fraction:.1%} of the low-precision parameters it had gradients for "
            "(optim/update_fraction): AdamW's small updates are below bfloat16/float16 resolution and are rounded "
            "away, so the model barely trains. Keep float32 master weights (model.policy.dtype: float32 with "
            "trainer.precision: bf16-mixed, or FSDP2 with trainer.strategy: fsdp2_bf16), or keep bf16 weights with "
            "model.optim.optimizer: adamw_kahan or adamw_bf16_sr (pip install 'rlflow[precision]').",
            category=LostUpdatesWarning,
        )
