"""The settings groups of :class:`~rlflow.training.module.GRPOModule` (``model.optim``, ``model.update``,
``model.reference``, ``model.rollout_correction``, ``model.policy``).

Each group is a frozen dataclass whose field docstrings are what ``rlflow fit --help`` shows
(``--model.optim.lr``), and which checks its own values when it is built: a wrong value is one
:class:`~rlflow.config_error.ConfigError` naming the full key (``model.optim.lr must be > 0.0, got 0``). From
Python a group is the dataclass or a mapping of its fields (:meth:`SettingsGroup.coerce`).

The loss's hyper-parameters (``epsilon_low``, ``epsilon_high``, ``kl_coef``, ``kl_type``) are not here: they
live in ``model.loss.init_args`` only. The sampling temperature and completion budget the log-probs and the
loss normalisers use are the datamodule's (``data.sampling``), read through the experience source.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from rlflow.config_checks import Rule, SettingsGroup, at_least, greater_than, interval, one_of
from rlflow.config_error import ConfigError
from rlflow.models.lora import LoraSettings
from rlflow.training.optim import OPTIMIZERS

#: ``model.policy.dtype`` values.
DTYPE_NAMES = ("float32", "bfloat16", "float16")
#: ``model.rollout_correction.mode`` values (``off`` also disables the default of pipelined runs).
CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "off")


def _betas(key: str, value: Any) -> None:
    ok = isinstance(value, (tuple, list)) and len(value) == 2 and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) and 0.0 <= b < 1.0 for b in value)
    if not ok:
        raise ConfigError(f"{key} must be two numbers in [0, 1), got {value!r}")


def _count(low: int) -> Rule:
    """An integer (not a bool) >= ``low``."""

    def check(key: str, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{key} must be an integer >= {low}, got {value!r}")

    return check


@dataclass(frozen=True)
class OptimSettings(SettingsGroup):
    """``model.optim``: the optimizer and its learning-rate schedule."""

    key: ClassVar[str] = "model.optim"
    rules: ClassVar[dict[str, Rule]] = {
        "optimizer": one_of(*OPTIMIZERS),
        "lr": greater_than(0.0),
        "weight_decay": at_least(0.0),
        "betas": _betas,
        "warmup_steps": _count(0),
        "lr_schedule": one_of("constant", "linear", "cosine"),
        "max_grad_norm": greater_than(0.0, optional=True),
    }

    optimizer: str = "adamw"
    """``adamw`` (torch; for float32 parameters), or for bfloat16 parameters ``adamw_bf16_sr`` (torchao,
    stochastic rounding) or ``adamw_kahan`` (torch-optimi, Kahan summation), which keep updates far below bf16
    resolution; the latter two need ``pip install 'rlflow[precision]'``."""
    lr: float = 1e-6
    """Peak learning rate of AdamW."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up to ``lr`` (step ``i`` at ``lr * (i + 1) / warmup_steps``)."""
    lr_schedule: str = "constant"
    """After warm-up: ``constant``, ``linear`` (to 0 at the end) or ``cosine``; the schedule spans
    ``trainer.estimated_stepping_batches x model.update.optimizer_steps x model.update.num_iterations``
    optimizer steps (torch's ``LinearLR``/``CosineAnnealingLR``)."""
    max_grad_norm: float | None = 1.0
    """Gradient clipping by global norm; None disables it."""

    def check(self) -> None:
        need = OPTIMIZERS[self.optimizer]
        if need is not None and importlib.util.find_spec(need[0]) is None:
            raise ConfigError(f"model.optim.optimizer={self.optimizer} needs the {need[1]} package: pip install "
                              f"'rlflow[precision]' (or pip install {need[1]})")


@dataclass(frozen=True)
class UpdateSettings(SettingsGroup):
    """``model.update``: how one rollout step's experience becomes optimizer steps."""

    key: ClassVar[str] = "model.update"
    rules: ClassVar[dict[str, Rule]] = {
        "optimizer_steps": _count(1),
        "num_iterations": _count(1),
        "micro_batch_size": _count(1),
        "pack_max_length": _count(1),
        "logprob_chunk_size": _count(1),
        "max_consecutive_skipped_steps": _count(1),
    }

    optimizer_steps: int = 1
    """Optimizer steps (mini-batches) per rollout step."""
    num_iterations: int = 1
    """Passes over the rollout's mini-batches (GRPO's mu); old log-probs are computed once before them."""
    micro_batch_size: int = 32
    """Sequences per forward/backward pass; gradients accumulate over a mini-batch."""
    packing: bool = True
    """Padding-free training: pack prompt + completion sequences end to end into micro-batches of at most
    ``pack_max_length`` tokens (attention kept per sequence); replaces ``micro_batch_size``. Checked once at the
    start of ``fit`` (:mod:`rlflow.training.packing_support`): a model whose packed log-probs would differ from
    padded ones trains on padded micro-batches instead, with a warning saying why."""
    pack_max_length: int = 4096
    """Token budget of one packed micro-batch (a longer single sequence gets its own)."""
    logprob_chunk_size: int = 1024
    """Positions per chunk when turning hidden states into log-probs (bounds the logits memory)."""
    skip_zero_advantage: bool = False
    """Leave sequences that train nothing out of the backward pass: those whose advantage is 0 (every completion
    of their group got the same reward) and, where the loss masks truncated completions, truncated ones. Their
    gradient is exactly zero under the built-in losses without a KL term or entropy bonus, so the update is the
    same up to float rounding; they still run a forward pass without gradients, for the metrics. Refused at
    startup where it would change the update: a KL term, an entropy bonus, a mixture-of-experts policy
    (:mod:`rlflow.training.zero_advantage`)."""
    max_consecutive_skipped_steps: int = 3
    """Stop the run after this many optimizer steps in a row with a NaN/inf loss or gradient."""
    reuse_freed_memory: bool | None = None
    """Keep large freed blocks in the training process's heap, so each step's large tensors (logits chunks, 16-bit
    weight casts, gradients) reuse memory already faulted in rather than fresh zeroed pages (glibc on Linux;
    :mod:`rlflow.training.host_memory`). The process's resident memory then stays near its peak. None: on where
    the policy trains on a CPU, off elsewhere."""


@dataclass(frozen=True)
class ReferenceSettings(SettingsGroup):
    """``model.reference``: the KL reference, loaded iff the loss's ``kl_coef`` is > 0
    (``model.loss.init_args.kl_coef``)."""

    key: ClassVar[str] = "model.reference"
    rules: ClassVar[dict[str, Rule]] = {
        "sync_steps": _count(0),
        "mixup_alpha": interval(0.0, 1.0, low_open=True),
    }

    path: str | None = None
    """Reference model; defaults to ``model.model_path`` (with ``model.lora``: the policy with its adapters
    disabled, no second copy, unless this is set)."""
    sync_steps: int = 0
    """Every this many rollout steps, move the KL reference toward the policy:
    ``ref <- mixup_alpha * policy + (1 - mixup_alpha) * ref`` (TRL's ``sync_ref_model``, TR-DPO; alpha 1 resets
    it to the policy, as ProRL does). The reference is then checkpointed with the policy. 0 (the default): the
    reference stays fixed. Needs a KL term; not with ``model.lora``. See :mod:`rlflow.training.reference`."""
    mixup_alpha: float = 0.6
    """The weight of the policy in that update, in (0, 1]."""

    def check_use(self, uses_reference: bool, lora: bool) -> None:
        """ConfigError unless ``sync_steps`` can act on this run: a KL term (so a reference is loaded), no LoRA."""
        if not self.sync_steps:
            return
        if not uses_reference:
            raise ConfigError(f"model.reference.sync_steps={self.sync_steps} moves the KL reference, but this loss "
                              "has no KL term (model.loss.init_args.kl_coef is 0), so no reference is loaded: set "
                              "model.loss.init_args.kl_coef > 0 or model.reference.sync_steps=0")
        if lora:
            raise ConfigError(f"model.reference.sync_steps={self.sync_steps} is not supported with model.lora: the "
                              "reference is the base model under the adapters (or model.reference.path, into which "
                              "the adapters would have to be merged); set model.reference.sync_steps=0")


@dataclass(frozen=True)
class RolloutCorrectionSettings(SettingsGroup):
    """``model.rollout_correction``: importance weights for the rollout engine's and the trainer's different
    probabilities of the same tokens (:mod:`rlflow.training.correction`)."""

    key: ClassVar[str] = "model.rollout_correction"
    rules: ClassVar[dict[str, Rule]] = {
        "mode": one_of(*CORRECTION_MODES, optional=True),
        "cap": greater_than(0.0),
        "min": at_least(0.0, optional=True),
    }

    mode: str | None = None
    """``token_truncate``, ``sequence_truncate`` (TIS), ``token_mask``, ``sequence_mask`` (MIS). None: off, except
    with pipelined generation (``data.pipeline.max_staleness > 0``), where it defaults to ``token_truncate``
    against the generator's (behaviour) log-probs; ``off`` disables it there too."""
    cap: float = 2.0
    """Upper bound of the rollout importance ratio (truncated to it, or masked above it)."""
    min: float | None = None
    """MIS only: also mask rollout importance ratios below this."""

    def check(self) -> None:
        if self.min is not None and not 0.0 <= self.min < self.cap:
            raise ConfigError(f"model.rollout_correction.min must be in [0, model.rollout_correction.cap="
                              f"{self.cap}), got {self.min!r}")

    @property
    def on(self) -> bool:
        """Whether a correction mode is set (pipelined runs may still turn one on, unless it is ``off``)."""
        return self.mode is not None and self.mode != "off"


@dataclass(frozen=True)
class PolicySettings(SettingsGroup):
    """``model.policy``: how the policy model is loaded and run."""

    key: ClassVar[str] = "model.policy"
    rules: ClassVar[dict[str, Rule]] = {
        "dtype": one_of(*DTYPE_NAMES),
        "router_aux_loss_coef": at_least(0.0, optional=True),
    }

    dtype: str = "float32"
    """Parameter dtype: ``float32``, ``bfloat16`` or ``float16``. Keep ``float32`` (master weights) and get bf16
    compute from ``trainer.precision: bf16-mixed`` or FSDP2's ``param_dtype``; with ``bfloat16`` use
    ``model.optim.optimizer: adamw_kahan``/``adamw_bf16_sr`` (``optim/update_fraction`` shows the share of
    weights each step changed)."""
    attn_implementation: str | None = None
    """transformers attention implementation (``sdpa``, ``eager``, ``flash_attention_2``...)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    fast_rms_norm: bool = True
    """Give the policy's RMSNorm modules a hand-written backward pass (:mod:`rlflow.models.rms_norm`: the
    model's own forward, bit for bit; gradients equal to float32 rounding, in fewer passes over memory). Float32
    training only; other calls run the module's own forward."""
    disable_dropout: bool = True
    """Set the policy's dropout probabilities to 0 (TRL's ``disable_dropout``): with dropout the training
    forward's log-probs differ from the sampler's, the old policy's and the reference's for the same tokens,
    noise the ratio and the KL read as a policy change (:mod:`rlflow.models.dropout`). A LoRA adapter's own
    ``model.lora.dropout`` is kept."""
    cast_lm_head_to_fp32: bool = False
    """Keep the LM head's weights in float32 and compute its product in float32 (TRL's option; ScaleRL's fp32
    head), in the training forward, the old/reference passes and the engine's decode, so bf16 rounding of the
    logits does not move the ratio and the KL (:mod:`rlflow.models.lm_head`). Tied embeddings become float32 too.
    Refused with a PEFT adapter on the head."""
    router_aux_loss_coef: float | None = None
    """Weight of a mixture-of-experts policy's load-balancing loss added to each training micro-batch's loss
    (TRL's option; :mod:`rlflow.models.moe`); None: the model config's own (0.001 for Qwen3-MoE, 0 for a dense
    model); 0 disables it. Logged as ``aux_loss``."""
    freeze_vision_tower: bool = True
    """Vision-language models only: keep the vision encoder's weights fixed (the module named
    ``visual``/``vision_tower``/``vision_model``; Qwen2-VL's patch merger lives inside it, so it stays fixed
    too); the language model trains. See :mod:`rlflow.models.vision`."""


@dataclass(frozen=True)
class ModuleSettings:
    """Every setting of a :class:`~rlflow.training.module.GRPOModule` but its loss, as the module reads them
    (``module.settings``)."""

    model_path: str
    optim: OptimSettings
    update: UpdateSettings
    reference: ReferenceSettings
    rollout_correction: RolloutCorrectionSettings
    policy: PolicySettings
    lora: LoraSettings | None = None
    export_hf: bool = True

    @classmethod
    def of(cls, model_path: str, lora: Any = None, export_hf: bool = True, **groups: Any) -> ModuleSettings:
        """The settings from ``GRPOModule.__init__``'s arguments: each group a settings object, a mapping of
        its fields or None (its defaults); ``lora`` a :class:`LoraSettings`, a mapping of its fields or None."""
        unknown = sorted(set(groups) - set(GROUPS))
        if unknown:
            raise TypeError(f"unknown settings group {unknown[0]!r}")
        coerced = {name: GROUPS[name].coerce(groups.get(name)) for name in GROUPS}
        return cls(model_path=model_path, lora=LoraSettings.coerce(lora), export_hf=export_hf, **coerced)

    def hparams(self) -> dict[str, Any]:
        """The groups and ``lora`` as plain data: what the module's hyper-parameters (and so checkpoints)
        hold."""
        out: dict[str, Any] = {name: getattr(self, name).as_dict() for name in GROUPS}
        out["lora"] = None if self.lora is None else dataclasses.asdict(self.lora)
        return out


#: The groups by their argument name in ``GRPOModule.__init__``.
GROUPS: dict[str, type[SettingsGroup]] = {
    "optim": OptimSettings, "update": UpdateSettings, "reference": ReferenceSettings,
    "rollout_correction": RolloutCorrectionSettings, "policy": PolicySettings,
}


def grouped_hparams(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint's module hyper-parameters with every group as a mapping of its fields: grouped ones as they
    are, flat ones of the former schema (``lr``, ``ref_model_path``...) put in their groups
    (:mod:`rlflow.config_moves`); keys that are no module arguments any more (the loss shortcuts,
    ``temperature``, ``max_tokens``) are dropped."""
    from rlflow.config_moves import new_place

    out: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for key, value in hparams.items():
        new = new_place("model", key)
        if new is None:
            out[key] = value
            continue
        section, group, field = (new.split(".") + ["", ""])[:3]
        if section == "model" and group in GROUPS:
            groups.setdefault(group, {})[field] = value
    for name, fields in groups.items():
        given = out.get(name)
        out[name] = {**fields, **(dict(given) if isinstance(given, Mapping) else {})}
    return out
