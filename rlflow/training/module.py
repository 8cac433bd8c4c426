"""``GRPOModule``: the policy (and, with a KL term, a frozen reference) and one GRPO step, top to bottom.

One ``training_step`` is one rollout step: ask the datamodule for fresh experience sampled from the current
weights, compute old and reference log-probs where they are needed, then take ``optimizer_steps`` optimizer
steps over shuffled mini-batches, each accumulated over micro-batches (manual optimization). Lightning's
``global_step`` counts rollout steps, not optimizer steps (:mod:`rlflow.training.step_unit`). Metrics use TRL's names
so dashboards compare.

The loss owns its hyper-parameters (``model.loss.init_args``). ``model.epsilon_low``, ``epsilon_high``,
``kl_coef`` and ``kl_type`` are shortcuts into them: None (the default) leaves the loss's value, a value is
given to the loss, and a loss whose own setting differs is one :class:`~rlflow.config_error.ConfigError`
naming both keys. A reference model is loaded iff the loss that results has ``kl_coef > 0`` (with ``model.lora``
the reference is the policy with its adapters disabled, :mod:`rlflow.models.lora`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from rlflow import registry
from rlflow.config_checks import ConfigError, check_model_args
from rlflow.data.experience import Experience, collate
from rlflow.data.protocol import ExperienceSource
from rlflow.log import info, warn
from rlflow.losses.base import LossContext, PolicyLoss, masked_mean
from rlflow.models.dropout import disable_dropout
from rlflow.models.lm_head import cast_lm_head_to_fp32
from rlflow.models.lora import LoraSettings
from rlflow.models.model_path import check_model_path
from rlflow.models.moe import collect_router_logits, router_aux_coef
from rlflow.models.rms_norm import use_fast_rms_norm
from rlflow.training.checkpointing import gather_rng_states, restore_rng_state
from rlflow.training.correction import RolloutCorrection
from rlflow.training.distributed import (
    FSDP2Strategy,
    all_max,
    all_true,
    data_parallel_mesh,
    full_tensor,
    full_weights,
    gather_full_state_dict,
    is_sharded,
    reduce_metrics,
    shard_model,
    sharded_completion_logprobs,
    world_size,
)
from rlflow.training.evaluation import EvalMetrics
from rlflow.training.logprobs import completion_logprobs
from rlflow.training.optim import (
    UpdateFraction,
    build_lr_scheduler,
    build_optimizer,
    check_optimizer,
    rebuild_lr_scheduler,
)
from rlflow.training.packing import (
    balance_pack_count,
    collate_packed,
    pack_experiences,
    packed_completion_logprobs,
    varlen_supported,
)
from rlflow.training.packing_support import resolve_packing
from rlflow.training.reference import check_same_layout, check_sync, sync_reference
from rlflow.training.step_unit import count_rollout_step, optimizer_step

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: ``model.*`` settings that are shortcuts into the loss's own init_args of the same name.
LOSS_SETTINGS = ("epsilon_low", "epsilon_high", "kl_coef", "kl_type")
_MISSING = object()


class NonFiniteLossError(RuntimeError):
    """Too many optimizer steps in a row had a NaN or infinite loss or gradient."""


def load_causal_lm(
    path: str, dtype: str = "float32", attn_implementation: str | None = None, key: str = "model.model_path"
) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` (``AutoModelForImageTextToText`` for a vision-language model, see
    :mod:`rlflow.models.vision`) with a fast, clear error (naming ``key``) for a path that is neither on disk nor
    loadable
    from the hub (see :mod:`rlflow.models.model_path`)."""
    from rlflow.models.vision import model_auto_class

    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    check_model_path(path, key)
    local = Path(path).expanduser()
    kwargs: dict[str, Any] = {"dtype": DTYPES[dtype]}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    path = str(local) if local.exists() else path
    return model_auto_class(path).from_pretrained(path, **kwargs)


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in the backward pass (``model.gradient_checkpointing``):
    transformers' ``activation_checkpointing_enable``, or ``gradient_checkpointing_enable`` (its deprecated name,
    the only one before transformers 5.x), and no KV cache, which checkpointed layers cannot fill."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    model.config.use_cache = False


def emulated_bf16(precision: str, device: torch.device) -> str | None:
    """Why ``trainer.precision`` costs time on ``device``, or None: bf16 compute on a CPU that multiplies bf16 in
    software (neither AMX nor AVX512-BF16; a 1024^3 bf16 product ran 4.2x slower than float32 on such a Xeon),
    where a recipe written for one that has them (``configs/smollm2_gsm8k_cpu.yaml``) is better run in 32-true."""
    from rlflow.rollout.hardware import native_bf16

    if not precision.startswith("bf16") or device.type != "cpu" or native_bf16(device):
        return None
    return (f"trainer.precision={precision} on a CPU without bf16 hardware (no AMX or AVX512-BF16): its bf16 matrix "
            "products are emulated, several times slower than float32; set --trainer.precision 32-true")


def build_loss(loss: Any, settings: dict[str, Any], max_tokens: int) -> Any:
    """The loss object, with the ``model.*`` shortcut ``settings`` (None: not set) applied; see the module docstring.

    A name or mapping is built with the settings as defaults of what its config leaves unset; an object (what
    jsonargparse instantiates from ``class_path``/``init_args``, after ``rlflow.cli`` applied the settings) is
    then checked: each set setting must equal the loss's own value, else one ConfigError naming both keys.
    """
    given = {key: value for key, value in settings.items() if value is not None}
    loss_fn = registry.build("rlflow.losses", loss, **given, max_tokens=max_tokens)
    for key, value in given.items():
        have = getattr(loss_fn, key, _MISSING)
        if have is _MISSING:
            raise ConfigError(f"model.{key}={value!r} does not apply: the loss {type(loss_fn).__name__} has no {key}")
        if have != value:
            raise ConfigError(
                f"model.{key}={value!r} conflicts with the loss's own {key}={have!r} (model.loss.init_args.{key}); "
                f"set it in one place, preferably model.loss.init_args.{key}"
            )
    return loss_fn


class GRPOModule(L.LightningModule):
    """Owns the policy and reference models and runs the GRPO update."""

    def __init__(
        self,
        model_path: str,
        lr: float = 1e-6,
        optimizer: str = "adamw",
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 0,
        lr_schedule: str = "constant",
        max_grad_norm: float | None = 1.0,
        loss: str | PolicyLoss = "bnpo",
        epsilon_low: float | None = None,
        epsilon_high: float | None = None,
        kl_coef: float | None = None,
        kl_type: str | None = None,
        ref_model_path: str | None = None,
        ref_model_sync_steps: int = 0,
        ref_model_mixup_alpha: float = 0.6,
        rollout_is: str | None = None,
        rollout_is_cap: float = 2.0,
        rollout_is_min: float | None = None,
        optimizer_steps: int = 1,
        num_iterations: int = 1,
        micro_batch_size: int = 32,
        temperature: float = 1.0,
        max_tokens: int = 256,
        dtype: str = "float32",
        attn_implementation: str | None = None,
        gradient_checkpointing: bool = False,
        fast_rms_norm: bool = True,
        disable_dropout: bool = True,
        cast_lm_head_to_fp32: bool = False,
        router_aux_loss_coef: float | None = None,
        logprob_chunk_size: int = 1024,
        packing: bool = True,
        pack_max_length: int = 4096,
        max_consecutive_skipped_steps: int = 3,
        export_hf: bool = True,
        freeze_vision_tower: bool = True,
        lora: LoraSettings | None = None,
    ) -> None:
        """
        Args:
            model_path: Policy to train: a local Hugging Face model directory (or a hub id where the hub is reachable).
            lr: Peak learning rate of AdamW.
            optimizer: ``adamw`` (torch; for float32 parameters), or for bfloat16 parameters ``adamw_bf16_sr``
                (torchao, stochastic rounding) or ``adamw_kahan`` (torch-optimi, Kahan summation), which keep
                updates far below bf16 resolution; the latter two need ``pip install 'rlflow[precision]'``.
            weight_decay: AdamW weight decay.
            betas: AdamW betas.
            warmup_steps: Optimizer steps of linear warm-up to ``lr`` (step ``i`` at ``lr * (i + 1) / warmup_steps``).
            lr_schedule: After warm-up: ``constant``, ``linear`` (to 0 at the end) or ``cosine``; the
                schedule spans ``trainer.estimated_stepping_batches x optimizer_steps x num_iterations``
                optimizer steps (torch's ``LinearLR``/``CosineAnnealingLR``).
            max_grad_norm: Gradient clipping by global norm; None disables it.
            loss: Policy loss: a short name of the ``rlflow.losses`` group (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``,
                ``gspo``, ``luspo``, ``cispo``, ``sapo``, ``vespo``, or a plugin's), an import path, or
                ``class_path``/``init_args``
                (``--model.loss.help grpo`` lists a loss's options). The loss owns its hyper-parameters.
            epsilon_low: Shortcut for the loss's ``epsilon_low`` (lower clip range, ``1 - epsilon_low``); None keeps the
                loss's own (0.2); setting both to different values is an error.
            epsilon_high: Shortcut for the loss's ``epsilon_high`` (upper clip range, ``1 + epsilon_high``; DAPO's
                clip-higher uses 0.28); None keeps the loss's own (``epsilon_low``).
            kl_coef: Shortcut for the loss's ``kl_coef``, the weight of the KL penalty to the reference model; None
                keeps the loss's own (0). A reference model is loaded iff the loss's ``kl_coef`` is > 0.
            kl_type: Shortcut for the loss's ``kl_type``, the KL estimator: ``k1``, ``k2``, ``k3`` (``low_var_kl``) or
                ``abs``; None keeps the loss's own (``k3``).
            ref_model_path: Reference model; defaults to ``model_path`` (with ``lora``: the policy with its adapters
                disabled, no second copy, unless this is set).
            ref_model_sync_steps: Every this many rollout steps, move the KL reference toward the policy:
                ``ref <- ref_model_mixup_alpha * policy + (1 - ref_model_mixup_alpha) * ref`` (TRL's
                ``sync_ref_model``, TR-DPO; alpha 1 resets it to the policy, as ProRL does). The reference is then
                checkpointed with the policy. 0 (the default): the reference stays fixed. Needs a KL term; not with
                ``lora``. See :mod:`rlflow.training.reference`.
            ref_model_mixup_alpha: The weight of the policy in that update, in (0, 1].
            rollout_is: Rollout/training mismatch correction from the rollout engine's log-probs: ``token_truncate``,
                ``sequence_truncate`` (TIS), ``token_mask``, ``sequence_mask`` (MIS). None: off, except with pipelined
                generation (``data.max_staleness > 0``), where it defaults to ``token_truncate`` against the
                generator's (behaviour) log-probs; ``off`` disables it there too.
            rollout_is_cap: Upper bound of the rollout importance ratio (truncated to it, or masked above it).
            rollout_is_min: MIS only: also mask rollout importance ratios below this.
            optimizer_steps: Optimizer steps (mini-batches) per rollout step.
            num_iterations: Passes over the rollout's mini-batches (GRPO's mu); old log-probs are computed once before
                them.
            micro_batch_size: Sequences per forward/backward pass; gradients accumulate over a mini-batch.
            temperature: Temperature the log-probs are computed at; linked to ``data.temperature``.
            max_tokens: Most completion tokens; linked to ``data.max_tokens`` (used by normalisers such as Dr. GRPO's).
            dtype: Parameter dtype: ``float32``, ``bfloat16`` or ``float16``. Keep ``float32`` (master weights) and
                get bf16 compute from ``trainer.precision: bf16-mixed`` or FSDP2's ``param_dtype``; with
                ``bfloat16`` use ``optimizer: adamw_kahan``/``adamw_bf16_sr`` (``optim/update_fraction`` shows
                the share of weights each step changed).
            attn_implementation: transformers attention implementation (``sdpa``, ``eager``, ``flash_attention_2``...).
            gradient_checkpointing: Recompute activations in the backward pass to save memory.
            fast_rms_norm: Give the policy's RMSNorm modules a hand-written backward pass
            (:mod:`rlflow.models.rms_norm`:
                the model's own forward, bit for bit; gradients equal to float32 rounding, in fewer passes over
                memory). Float32 training only; other calls run the module's own forward.
            disable_dropout: Set the policy's dropout probabilities to 0 (TRL's ``disable_dropout``): with dropout
                the training forward's log-probs differ from the sampler's, the old policy's and the reference's
                for the same tokens, noise the ratio and the KL read as a policy change (:mod:`rlflow.models.dropout`).
                A LoRA adapter's own ``model.lora.dropout`` is kept.
            cast_lm_head_to_fp32: Keep the LM head's weights in float32 and compute its product in float32 (TRL's
                option; ScaleRL's fp32 head), in the training forward, the old/reference passes and the engine's
                decode, so bf16 rounding of the logits does not move the ratio and the KL
                (:mod:`rlflow.models.lm_head`).
                Tied embeddings become float32 too. Refused with a PEFT adapter on the head.
            router_aux_loss_coef: Weight of a mixture-of-experts policy's load-balancing loss added to each training
                micro-batch's loss (TRL's option; :mod:`rlflow.models.moe`); None: the model config's own (0.001 for
                Qwen3-MoE, 0 for a dense model); 0 disables it. Logged as ``aux_loss``.
            logprob_chunk_size: Positions per chunk when turning hidden states into log-probs (bounds the logits
                memory).
            packing: Padding-free training: pack prompt + completion sequences end to end into micro-batches of at most
                ``pack_max_length`` tokens (attention kept per sequence); replaces ``micro_batch_size``. Checked once
                at the start of ``fit`` (:mod:`rlflow.training.packing_support`): a model whose packed log-probs would
                differ from padded ones trains on padded micro-batches instead, with a warning saying why.
            pack_max_length: Token budget of one packed micro-batch (a longer single sequence gets its own).
            max_consecutive_skipped_steps: Stop the run after this many optimizer steps in a row with a NaN/inf loss
                or gradient.
            export_hf: At the end of ``fit``, write the policy and tokenizer with ``save_pretrained`` to
                ``<log_dir>/hf`` (with ``lora``: the merged model there, the adapter in ``<log_dir>/hf_adapter``).
            freeze_vision_tower: Vision-language models only: keep the vision encoder's weights fixed (the module
                named ``visual``/``vision_tower``/``vision_model``; Qwen2-VL's patch merger lives inside it, so it
                stays fixed too); the language model trains. See :mod:`rlflow.models.vision`.
            lora: Train PEFT LoRA adapters instead of the full weights (``r``, ``alpha``, ``dropout``,
                ``target_modules``, any other ``peft.LoraConfig`` field in ``options``; ``pip install
                'rlflow[lora]'``). Only the adapters train and are checkpointed; the KL reference is the same model
                with its adapters disabled. None (the default): full fine-tuning.
        """
        check_model_args(locals())
        super().__init__()
        self.lora = LoraSettings.coerce(lora)
        if self.lora is not None:
            self.lora.peft_config()  # PEFT installed and the options valid: fail now, not after loading the model
        self.save_hyperparameters(ignore=["lora"])
        self.hparams["lora"] = None if self.lora is None else dataclasses.asdict(self.lora)  # plain data in checkpoints
        self.automatic_optimization = False
        check_optimizer(optimizer)
        check_model_path(model_path, "model.model_path")  # before anything slow: a wrong path fails in a second
        if ref_model_path is not None:
            check_model_path(ref_model_path, "model.ref_model_path")
        settings = {"epsilon_low": epsilon_low, "epsilon_high": epsilon_high, "kl_coef": kl_coef, "kl_type": kl_type}
        self.loss_fn = build_loss(loss, settings, max_tokens)
        check_sync(ref_model_sync_steps, ref_model_mixup_alpha, self.uses_reference, self.lora is not None)
        on = rollout_is is not None and rollout_is != "off"
        self.correction = RolloutCorrection(rollout_is, rollout_is_cap, rollout_is_min) if on else None
        if on and self.correction.sequence_level and getattr(self.loss_fn, "own_importance_weights", False):
            raise ConfigError(f"model.loss={type(self.loss_fn).__name__} folds token-level rollout correction weights "
                              f"into its own sequence weight; model.rollout_is={rollout_is} is sequence-level: use "
                              "token_truncate or token_mask")
        self.policy: torch.nn.Module | None = None
        self.policy_version = 0  # optimizer steps taken: the version of the weights that sample next
        self.num_tokens = 0.0  # TRL's cumulative prompt + completion tokens
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.trained_versions: list[tuple[int, int]] = []  # (policy_version at the update, versions sampled)
        self.packing_checked: bool | None = None  # model.packing after the check at fit start (None: not checked)
        self.vision: Any = None  # rlflow.models.vision.VisionBatches for a vision-language policy
        self.router_aux = 0.0  # the MoE load-balancing loss's weight, set when the policy is loaded
        self.correction_in_forward = False  # pipelined, one update per rollout step: IS weights from its forward
        self._is_tokens: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    # --------------------------------------------------------------------------------------------- models
    @property
    def uses_reference(self) -> bool:
        """Whether the loss has a KL term, so a frozen reference is loaded (its ``kl_coef`` is the one switch)."""
        return float(getattr(self.loss_fn, "kl_coef", 0.0) or 0.0) > 0.0

    @property
    def ref_model(self) -> torch.nn.Module | None:
        """The frozen reference. Kept out of ``state_dict`` (it never changes, so checkpoints need not hold it),
        unless ``model.ref_model_sync_steps`` moves it: then it is the submodule ``reference``, checkpointed."""
        fixed = self.__dict__.get("_ref_model")
        return fixed if fixed is not None else self._modules.get("reference")

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        hp = self.hparams
        self.policy = load_causal_lm(hp.model_path, hp.dtype, hp.attn_implementation)
        self.policy.train()
        if hp.get("disable_dropout", True):
            switched = disable_dropout(self.policy)
            if switched:
                info(f"model.disable_dropout: set {len(switched)} dropout probabilities of the policy to 0 "
                     f"({', '.join(switched[:3])}{', ...' if len(switched) > 3 else ''})")
        self.setup_vision()
        if hp.get("fast_rms_norm", True):
            use_fast_rms_norm(self.policy)
        if hp.gradient_checkpointing:
            enable_activation_checkpointing(self.policy)
        if self.lora is not None:  # adapters injected in place: self.policy stays the model that runs
            from rlflow.models.lora import apply_lora

            self.__dict__["_peft_model"] = apply_lora(self.policy, self.lora)
        if hp.get("cast_lm_head_to_fp32", False):
            cast_lm_head_to_fp32(self.policy)
        self.router_aux = router_aux_coef(self.policy, hp.get("router_aux_loss_coef"))
        if self.uses_reference and (self.lora is None or hp.ref_model_path):  # LoRA: the base is the reference
            key = "model.ref_model_path" if hp.ref_model_path else "model.model_path"
            ref = load_causal_lm(hp.ref_model_path or hp.model_path, hp.dtype, hp.attn_implementation, key)
            ref.requires_grad_(False)
            if hp.get("cast_lm_head_to_fp32", False):
                cast_lm_head_to_fp32(ref)
            # it will move: checkpointed with the policy (rlflow.training.reference)
            if hp.get("ref_model_sync_steps", 0):
                check_same_layout(self.policy, ref)
                self.reference = ref.train()  # in train mode like the rest of the module; its forwards switch to eval
            else:
                self.__dict__["_ref_model"] = ref.eval()
        self.shard_models()

    def setup_vision(self) -> None:
        """A vision-language policy: its processor for the training forwards, and its vision tower frozen unless
        ``model.freeze_vision_tower`` is false (:mod:`rlflow.models.vision`)."""
        from rlflow.models.vision import VisionBatches, freeze_vision_tower, is_vision_model, load_processor

        if not is_vision_model(self.policy):
            return
        self.vision = VisionBatches(self.policy, load_processor(self.hparams.model_path))
        if self.hparams.get("freeze_vision_tower", True):
            frozen = freeze_vision_tower(self.policy)
            info(f"model.freeze_vision_tower: {frozen:,} vision-tower parameters frozen")

    @property
    def peft_model(self) -> Any:
        """PEFT's wrapper of the policy under ``model.lora`` (None otherwise); kept out of the module tree, the
        policy itself being the model that runs (:mod:`rlflow.models.lora`)."""
        return self.__dict__.get("_peft_model")

    @property
    def sharded(self) -> bool:
        """Whether the models are FSDP2-sharded (the trainer's strategy is a ``ModelParallelStrategy``)."""
        return self._trainer is not None and is_sharded(self.trainer.strategy)

    def shard_models(self) -> None:
        """Under ``trainer.strategy=fsdp``: ``fully_shard`` the policy and the reference, layer by layer, then root."""
        if not self.sharded:
            return
        strategy = self.trainer.strategy
        mesh = data_parallel_mesh(strategy)
        options = {}
        if isinstance(strategy, FSDP2Strategy):
            options = dict(mp_policy=strategy.mp_policy(), offload_policy=strategy.offload_policy(),
                           reshard_after_forward=strategy.reshard_after_forward)
        shard_model(self.policy, mesh, **options)
        if self.ref_model is not None:
            shard_model(self.ref_model, mesh, **options)

    def on_fit_start(self) -> None:
        if self.ref_model is not None and not self.sharded:  # a sharded reference already sits on its devices
            self.ref_model.to(self.device)
        slow = emulated_bf16(str(self.trainer.precision), self.device)
        if slow:
            warn(slow)
        self.experience.bind(self.policy)
        self.check_pipelining(getattr(self.experience, "max_staleness", 0))
        self.packing_checked = resolve_packing(bool(self.hparams.get("packing")), [self.policy, self.ref_model],
                                               self.sharded, self.hparams.pack_max_length)

    def check_pipelining(self, max_staleness: int) -> None:
        """With ``data.max_staleness > 0`` (:mod:`rlflow.rollout.pipeline`): the bound must admit the one-step
        pipeline's staleness, and the importance-sampling correction is on unless ``model.rollout_is: off``."""
        if not max_staleness:
            return
        hp = self.hparams
        per_step = hp.optimizer_steps * hp.num_iterations
        if max_staleness < per_step:
            raise ConfigError(
                f"data.max_staleness={max_staleness} is below the pipeline's staleness of {per_step} policy versions "
                f"(model.optimizer_steps={hp.optimizer_steps} x model.num_iterations={hp.num_iterations}): every "
                f"batch would be stale; set data.max_staleness >= {per_step} or 0")
        if self.correction is None and hp.rollout_is != "off":
            self.correction = RolloutCorrection("token_truncate", hp.rollout_is_cap, hp.rollout_is_min)
            info(f"data.max_staleness={max_staleness}: rollout importance-sampling correction token_truncate "
                 f"(cap {hp.rollout_is_cap}) against the generator's log-probs; model.rollout_is=off disables it")
        # one update per rollout step: the training forward's own log-probs are the weights at the step's start,
        # so the token IS weights come from it, without a separate old-log-prob pass
        self.correction_in_forward = bool(self.correction) and per_step == 1 and not self.correction.sequence_level

    @property
    def packing(self) -> bool:
        """Whether micro-batches are packs: ``model.packing`` as checked at fit start (as configured before it)."""
        return self.packing_checked if self.packing_checked is not None else bool(self.hparams.get("packing"))

    def on_validation_start(self) -> None:
        self.experience.bind(self.policy)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = build_optimizer(hp.get("optimizer", "adamw"), params, hp.lr, hp.betas, hp.weight_decay)
        # the trainer counts rollout steps (training_step calls); the schedule counts optimizer steps
        rollout_steps = max(int(self.trainer.estimated_stepping_batches), 1) if self._trainer is not None else 1
        total = rollout_steps * hp.optimizer_steps * hp.num_iterations
        self.lr_schedule_steps = total  # checkpointed: a run continued with another max_steps re-spans the schedule
        scheduler = build_lr_scheduler(optimizer, hp.lr_schedule, hp.warmup_steps, total)
        self.update_fraction = UpdateFraction(params, hp.get("optimizer", "adamw"))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------------------------------ log-probs
    def micro_batches(self, experiences: list[Experience]) -> list[list[Experience]]:
        """Split into micro-batches: token-budget packs with ``packing``, else ``micro_batch_size`` sequences.

        Sharded, every rank splits its packs until all have as many as the rank with the most: each micro-batch
        is an FSDP2 forward (and backward), collectives every rank must join. (Padded micro-batches need no such
        step: every rank holds the same number of sequences.)
        """
        if self.packing:
            share = varlen_supported(self.policy)
            packs = pack_experiences(experiences, self.hparams.pack_max_length, share_prompts=share)
            return balance_pack_count(packs, all_max(len(packs))) if self.sharded else packs
        mb = self.hparams.micro_batch_size
        return [experiences[start: start + mb] for start in range(0, len(experiences), mb)]

    def logprobs_of(
        self, model: torch.nn.Module, experiences: list[Experience]
    ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        if self.packing:
            packed = collate_packed(experiences, share_prompts=varlen_supported(model))  # a group's prompt once
            batch = {k: v.to(self.device) for k, v in packed.items()}
            logprobs, entropy = packed_completion_logprobs(
                model, batch, self.hparams.temperature, self.hparams.logprob_chunk_size, sharded=self.sharded)
            return logprobs, entropy, batch
        batch = collate(experiences, self.pad_id)
        if self.vision is not None:  # each sequence's images in context (rlflow.models.vision)
            batch = self.vision.add_inputs(batch, experiences, self.pad_id)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        stats = sharded_completion_logprobs if self.sharded else completion_logprobs
        logprobs, entropy = stats(model, batch, self.hparams.temperature, self.hparams.logprob_chunk_size)
        return logprobs, entropy, batch

    @torch.no_grad()
    def fill_logprobs(self, experiences: list[Experience], attr: str, model: torch.nn.Module) -> None:
        """Store ``model``'s log-probs of each completion in ``experience.<attr>`` (old or reference log-probs)."""
        was_training = model.training
        model.eval()
        try:
            for chunk in self.micro_batches(experiences):
                logprobs, _, batch = self.logprobs_of(model, chunk)
                for e, row in zip(chunk, logprobs.float().cpu()):
                    setattr(e, attr, row[: len(e.completion_ids)].tolist())
        finally:
            model.train(was_training)

    @property
    def pad_id(self) -> int:
        tok = self.experience.tokenizer
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    # ----------------------------------------------------------------------------------------- training
    @property
    def experience(self) -> ExperienceSource:
        """The datamodule, through the one interface a GRPO step uses
        (:class:`~rlflow.data.protocol.ExperienceSource`)."""
        return self.trainer.datamodule

    def training_step(self, batch: list, batch_idx: int) -> None:
        """One rollout step: sample and score fresh experience, fix old/reference log-probs, take the updates."""
        start = time.perf_counter()
        hp = self.hparams
        # 1. generate k completions per prompt with the current weights, judge them, compute group advantages
        with full_weights(self.policy if self.experience.reads_policy_weights else None):
            rollout = self.experience.make_experience(batch, policy_version=self.policy_version, step=self.global_step)
        metrics = dict(rollout.metrics)
        minibatches = self.experience.minibatches(hp.optimizer_steps)
        everything = [e for mb in minibatches for e in mb]
        # 2. the ratio's denominator (needed once later updates are off-policy, or to compare with the rollout
        #    engine's log-probs) and the reference log-probs, both fixed before any update
        separate_old = self.correction is not None and not self.correction_in_forward
        if hp.optimizer_steps > 1 or hp.num_iterations > 1 or separate_old:
            self.fill_logprobs(everything, "old_logprobs", self.policy)
        if self.ref_model is not None:
            self.fill_logprobs(everything, "ref_logprobs", self.ref_model)
        elif self.uses_reference and self.peft_model is not None:  # the same model with its adapters disabled
            from rlflow.models.lora import adapters_disabled

            with adapters_disabled(self.peft_model):
                self.fill_logprobs(everything, "ref_logprobs", self.policy)
        self._is_tokens = [] if self.correction_in_forward else None
        if separate_old:
            batch_all = collate(everything, self.pad_id)
            metrics.update(self.correction.metrics(
                batch_all["old_logprobs"], batch_all["rollout_logprobs"], batch_all["completion_mask"]))
        # 3. num_iterations passes (GRPO's mu) over optimizer_steps mini-batches, one optimizer step each
        generation_seqs, generation_tokens = self.global_counts([len(everything), self.loss_tokens(everything)])
        sums: dict[str, float] = {}
        rollout_step = self.global_step
        updates = [mb for _ in range(hp.num_iterations) for mb in minibatches]  # GRPO's mu: old log-probs fixed above
        for i, minibatch in enumerate(updates):  # only the last optimizer step counts in global_step (step_unit)
            last = i == len(updates) - 1
            sums = self.optimizer_step_on(minibatch, generation_tokens, generation_seqs, sums, count=last)
        if self.global_step == rollout_step:  # that step was skipped: the rollout step counts all the same
            count_rollout_step(self.optimizers())
        self.maybe_sync_reference(rollout_step + 1)
        if self._is_tokens:  # the IS metrics of the weights from the training forward (correction_in_forward)
            old_t, rollout_t = (torch.cat(parts) for parts in zip(*self._is_tokens))
            metrics.update(self.correction.metrics(old_t, rollout_t, torch.ones_like(old_t, dtype=torch.bool)))
        self._is_tokens = None
        # 4. metrics: global values under data parallelism; "loss" is each rank's share, so it adds up
        n = len(minibatches) * hp.num_iterations
        metrics.update({key: value / n for key, value in sums.items()})
        metrics = reduce_metrics(metrics, samples_per_rank=len(everything), sum_keys={"loss"})
        self.num_tokens += metrics.pop("num_prompt_tokens") + metrics.pop("num_completion_tokens")
        metrics["num_tokens"] = self.num_tokens
        metrics["train/skipped_steps"] = float(self.skipped_steps)
        metrics["lr"] = float(self.optimizers().param_groups[0]["lr"])  # a tensor in torchao's optimizers
        metrics["step_time"] = time.perf_counter() - start
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(everything))
        self.last_metrics = metrics
        self.last_rollout = rollout

    def maybe_sync_reference(self, rollout_steps_done: int) -> None:
        """After every ``model.ref_model_sync_steps``-th rollout step, move the reference toward the policy
        (:func:`rlflow.training.reference.sync_reference`; every rank its own shards)."""
        every = self.hparams.get("ref_model_sync_steps", 0)
        if not every or rollout_steps_done % every or self.ref_model is None:
            return
        alpha = self.hparams.ref_model_mixup_alpha
        sync_reference(self.ref_model, self.policy, alpha)
        info(f"rollout step {rollout_steps_done - 1}: the KL reference moved toward the policy "
             f"(model.ref_model_mixup_alpha={alpha})")

    def optimizer_step_on(
        self, minibatch: list[Experience], generation_tokens: int, generation_seqs: int, sums: dict, count: bool = True
    ) -> dict:
        """One optimizer step over ``minibatch``, accumulated over micro-batches; adds its metrics to ``sums``.

        ``count``: whether the step advances ``trainer.global_step`` (one per rollout step, see
        :mod:`rlflow.training.step_unit`).
        """
        hp = self.hparams
        opt = self.optimizers()
        sched = self.lr_schedulers()
        self.trained_versions.append((self.policy_version, max(e.policy_version for e in minibatch)))
        mini_seqs, mini_tokens = self.global_counts([len(minibatch), self.loss_tokens(minibatch)])
        ctx = LossContext(
            mini_batch_sequences=mini_seqs,
            mini_batch_tokens=mini_tokens,
            generation_batch_sequences=generation_seqs,
            generation_batch_tokens=generation_tokens,
            max_tokens=hp.max_tokens,
            world_size=self.trainer.world_size,
        )
        opt.zero_grad(set_to_none=True)
        step: dict[str, float] = {}
        finite = True
        for micro in self.micro_batches(minibatch):
            routers = collect_router_logits(self.policy) if self.router_aux else contextlib.nullcontext()
            with routers as caught:  # an MoE policy's router logits, for its load-balancing loss
                logprobs, entropy, batch = self.logprobs_of(self.policy, micro)
            mask = batch["completion_mask"]
            old = batch["old_logprobs"] if micro[0].old_logprobs is not None else logprobs.detach()
            ref = batch["ref_logprobs"] if micro[0].ref_logprobs is not None else None
            is_weights = None
            if self.correction is not None:
                is_weights = self.correction.weights(old, batch["rollout_logprobs"], mask)
                if self._is_tokens is not None:
                    self._is_tokens.append((old[mask].float().cpu(), batch["rollout_logprobs"][mask].float().cpu()))
            loss, loss_metrics = self.loss_fn(
                logprobs, old, batch["advantages"], mask, ref_logprobs=ref,
                rollout_logprobs=batch["rollout_logprobs"], entropy=entropy, truncated=batch["truncated"],
                rollout_is_weights=is_weights, ctx=ctx,
            )
            if caught is not None:
                aux = caught.aux_loss()
                loss = loss + self.router_aux * aux.to(loss.device)
                loss_metrics["aux_loss"] = float(aux.detach())
            if getattr(self.loss_fn, "mask_truncated_completions", False):  # the weight counts the loss's tokens
                mask = mask & ~batch["truncated"].unsqueeze(1)
            weight = self.loss_fn.micro_batch_weight(mask, ctx)
            if not torch.isfinite(loss):
                finite = False
                if world_size() == 1:
                    break
                self.manual_backward(logprobs.sum() * 0.0)  # keep FSDP's gradient collectives in step with the ranks
                continue
            with self.all_cores():
                self.manual_backward(loss * weight)
            share = len(micro) / len(minibatch)  # metrics: a sequence-weighted mean over the micro-batches
            loss_metrics["entropy"] = masked_mean(entropy.detach(), batch["completion_mask"]).item()
            for key, value in loss_metrics.items():
                step[key] = step.get(key, 0.0) + share * float(value)
            step["loss"] = step.get("loss", 0.0) + weight * loss.item() / max(self.trainer.world_size, 1)
        grad_norm = torch.tensor(0.0)
        if world_size() > 1:
            finite = all_true(finite)
        if finite:
            grad_norm = self.clip_gradients_and_norm(hp.max_grad_norm)
            finite = bool(torch.isfinite(grad_norm))
        if not finite:
            self.loss_fn.on_skipped_step()
            self.skip_step(opt)
            return sums
        self.consecutive_skips = 0
        self.update_fraction.before_step()
        optimizer_step(self.trainer, opt, count)
        sched.step()
        step.update(self.loss_fn.on_optimizer_step(self.reduce_sum))  # a loss's own state (adaptive entropy)
        fraction = self.update_fraction.after_step(self.policy_version)
        if fraction is not None:
            step["optim/update_fraction"] = fraction
        self.policy_version += 1
        self.experience.sync_weights()
        step["grad_norm"] = float(grad_norm)
        for key, value in step.items():
            sums[key] = sums.get(key, 0.0) + value
        return sums

    def loss_tokens(self, experiences: list[Experience]) -> int:
        """Completion tokens the loss trains on (without truncated completions where the loss masks them)."""
        skip = getattr(self.loss_fn, "mask_truncated_completions", False)
        return sum(e.num_sampled for e in experiences if not (skip and e.truncated))

    def all_cores(self) -> contextlib.AbstractContextManager:
        """The data module's setting for the backward pass (pipelined on a CPU: the generator process's cores lent
        to it, :meth:`RolloutDataModule.all_cores`); as it is with any other data module."""
        trainer = self._trainer
        dm = getattr(trainer, "datamodule", None) if trainer is not None else None
        cores = getattr(dm, "all_cores", None)
        return cores() if cores is not None else contextlib.nullcontext()

    def reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over ranks (itself on one)."""
        if self.trainer is None or self.trainer.world_size == 1:
            return values
        return self.trainer.strategy.reduce(values.to(self.device), reduce_op="sum").cpu()

    def global_counts(self, values: list[int]) -> list[int]:
        """``values`` summed over ranks: the batch sizes the loss normalisers divide by."""
        if self.trainer is None or self.trainer.world_size == 1:
            return [int(v) for v in values]
        counts = torch.tensor(values, dtype=torch.long, device=self.device)
        summed = self.trainer.strategy.reduce(counts, reduce_op="sum")
        return [int(v) for v in summed.tolist()]

    def clip_gradients_and_norm(self, max_norm: float | None) -> torch.Tensor:
        params = [p for p in self.policy.parameters() if p.grad is not None]
        if not params:
            return torch.tensor(0.0)
        if self.sharded:  # DTensor gradients: the norm over every rank's shards
            return full_tensor(torch.nn.utils.clip_grad_norm_(params, math.inf if max_norm is None else max_norm))
        if max_norm is None:
            return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def skip_step(self, opt: Any) -> None:
        """Drop this optimizer step's gradients; stop the run after too many non-finite steps in a row."""
        opt.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        self.consecutive_skips += 1
        info(f"rollout step {self.global_step}: non-finite loss or gradient, optimizer step skipped "
             f"({self.consecutive_skips} in a row, {self.skipped_steps} in all)")
        if self.consecutive_skips >= self.hparams.max_consecutive_skipped_steps:
            raise NonFiniteLossError(
                f"{self.consecutive_skips} optimizer steps in a row had a NaN or infinite loss or gradient "
                f"(model.max_consecutive_skipped_steps={self.hparams.max_consecutive_skipped_steps}); lower model.lr, "
                "set model.max_grad_norm, or use model.dtype=float32. Checkpoints written so far are intact."
            )

    # ---------------------------------------------------------------------------------------- evaluation
    def on_validation_epoch_start(self) -> None:
        self.eval_metrics = EvalMetrics(self.experience.eval_k, self.experience.eval_data_sources).to(self.device)

    def validation_step(self, batch: list, batch_idx: int) -> dict[str, Any]:
        """Generate and judge the batch's eval samples, add them to the eval metrics, and return their rows
        (``{"samples": [...]}``, which :class:`rlflow.training.callbacks.TrajectoryWriter` and ``SampleTable`` read)."""
        with full_weights(self.policy if self.experience.reads_policy_weights else None):
            out = self.experience.evaluate(batch, step=self.global_step, batch_idx=batch_idx)
        self.eval_metrics.update(out["data_sources"], out["correct"], out["rewards"], out["lengths"], out.get("failed"),
                                 out.get("answers"))
        return {"samples": out.get("samples", [])}

    def on_validation_epoch_end(self) -> None:
        """Log ``eval/accuracy``, ``eval/pass@k``, ``eval/maj@k`` and the rest, overall and per ``data_source``, over
        every rank's prompts (:class:`rlflow.training.evaluation.EvalMetrics` gathers them)."""
        metrics = self.eval_metrics.compute() if self.eval_metrics.update_count else {}
        if metrics:
            self.log("eval/accuracy", metrics.pop("eval/accuracy"), on_epoch=True, prog_bar=True, rank_zero_only=True)
            self.log_dict(metrics, on_epoch=True, rank_zero_only=True)
        self.eval_metrics.reset()

    # --------------------------------------------------------------------------------------- checkpoints
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Under ``model.lora`` without the frozen base weights (they are ``model.model_path``'s): checkpoints
        hold the adapters, and the optimizer state holds only theirs."""
        state = super().state_dict(*args, **kwargs)
        if self.peft_model is None or args or kwargs.get("destination") is not None:
            return state
        from rlflow.models.lora import frozen_keys, trainable_state

        return trainable_state(state, frozen_keys(self.policy, kwargs.get("prefix", "") + "policy."))

    def load_state_dict(self, state_dict: Any, strict: bool = True, **kwargs: Any) -> Any:
        """Under ``model.lora`` a checkpoint's missing base weights are the live (never trained) ones. A checkpoint
        without the reference (``model.ref_model_sync_steps`` was 0) continues with the reference as loaded; one
        with a moved reference continues with that one, synced or not (a run without a KL term drops it)."""
        state_dict = self.reference_state(state_dict)
        if self.peft_model is not None:
            from rlflow.models.lora import complete_state, frozen_keys

            state_dict = complete_state(state_dict, super().state_dict(), frozen_keys(self.policy, "policy."))
        return super().load_state_dict(state_dict, strict=strict, **kwargs)

    def reference_state(self, state_dict: Any) -> Any:
        """``state_dict`` with the ``reference.*`` entries this module has (see :meth:`load_state_dict`)."""
        saved = any(k.startswith("reference.") for k in state_dict)
        if saved and "reference" not in self._modules and self.__dict__.get("_ref_model") is not None:
            info("the checkpoint holds a KL reference moved by model.ref_model_sync_steps: this run continues "
                 "with it, and with model.ref_model_sync_steps=0 it stays there")
            self.reference = self.__dict__.pop("_ref_model").train()  # checkpointed from now on (forwards: eval)
        if saved == ("reference" in self._modules):
            return state_dict
        if not saved:
            info("the checkpoint holds no KL reference (saved with model.ref_model_sync_steps=0): the reference "
                 "starts from model.ref_model_path / model.model_path and moves from here")
            return {**state_dict, **self.reference.state_dict(prefix="reference.")}
        return {k: v for k, v in state_dict.items() if not k.startswith("reference.")}  # no KL term now

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rlflow"] = {
            "policy_version": self.policy_version, "num_tokens": self.num_tokens, "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips, "lr_schedule_steps": getattr(self, "lr_schedule_steps", None),
            # every rank's Python/NumPy/torch RNG, so sampling after a resume draws what it would have drawn
            "rng": gather_rng_states(self.trainer.world_size if self._trainer is not None else 1),
            "loss": self.loss_fn.state_dict(),  # a loss's own training state (adaptive entropy control)
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("rlflow", {})
        self.policy_version = state.get("policy_version", 0)
        self.num_tokens = state.get("num_tokens", 0.0)
        self.skipped_steps = state.get("skipped_steps", 0)
        self.consecutive_skips = state.get("consecutive_skips", 0)
        self.loss_fn.load_state_dict(state.get("loss", {}))
        self._resume_rng = state.get("rng")  # applied in on_train_start, after Lightning's own set-up
        self._resume_lr_steps = state.get("lr_schedule_steps")  # likewise, once Lightning restored the scheduler
        trainer, step = self._trainer, checkpoint.get("global_step", 0)
        if trainer is not None and trainer.state.fn == "fit" and 0 <= (trainer.max_steps or -1) <= step:
            info(f"the checkpoint is at rollout step {step} and trainer.max_steps={trainer.max_steps}: the run is "
                 "already finished, nothing is trained (raise --trainer.max_steps to continue it)")

    def on_train_start(self) -> None:
        states, self._resume_rng = getattr(self, "_resume_rng", None), None
        if states and self.trainer.state.fn == "fit":
            rank = self.trainer.global_rank
            if len(states) == self.trainer.world_size:
                restore_rng_state(states[rank])
            else:
                info(f"the checkpoint holds RNG states of {len(states)} rank(s), this run has "
                     f"{self.trainer.world_size}: sampling continues from a fresh seed, not bit-exactly")
        self.respan_lr_schedule()

    def respan_lr_schedule(self) -> None:
        """After a resume with another ``max_steps`` (or ``max_epochs``), let a decaying schedule end where this
        run ends: the schedule of a run of the new length, at the optimizer step reached (Lightning restored the
        checkpoint's scheduler, which ended at the old length)."""
        saved, self._resume_lr_steps = getattr(self, "_resume_lr_steps", None), None
        hp, configs = self.hparams, self.trainer.lr_scheduler_configs
        if saved is None or saved == self.lr_schedule_steps or hp.lr_schedule == "constant" or not configs:
            return
        taken = configs[0].scheduler.last_epoch
        configs[0].scheduler = rebuild_lr_scheduler(
            configs[0].scheduler.optimizer, hp.lr_schedule, hp.warmup_steps, self.lr_schedule_steps, taken)
        info(f"model.lr_schedule={hp.lr_schedule} spans {self.lr_schedule_steps} optimizer steps now (the checkpoint's "
             f"run: {saved}); continuing at step {taken}, lr {float(self.optimizers().param_groups[0]['lr']):.3g}")

    def on_fit_end(self) -> None:
        if not self.hparams.export_hf:
            return
        log_dir = self.trainer.log_dir  # read on every rank: it is a broadcast under a distributed strategy
        state_dict = gather_full_state_dict(self.policy) if self.sharded else None  # a collective: every rank
        if self.trainer.is_global_zero and log_dir:
            if self.peft_model is not None:
                self.export_lora(Path(log_dir), state_dict)
            else:
                self.export_hf(Path(log_dir) / "hf", state_dict)

    @property
    def text_processor(self) -> Any:
        """What the exports save beside the weights: a VLM's processor (it holds the tokenizer), else the tokenizer."""
        return self.vision.images.processor if self.vision is not None else self.experience.tokenizer

    def export_hf(self, out_dir: Path, state_dict: dict[str, torch.Tensor] | None = None) -> Path:
        """Write the policy (or ``state_dict``, its gathered full weights) and tokenizer with ``save_pretrained``."""
        out_dir.mkdir(parents=True, exist_ok=True)
        self.policy.save_pretrained(out_dir, state_dict=state_dict)
        self.text_processor.save_pretrained(out_dir)
        info(f"exported the policy to {out_dir}")
        return out_dir

    def export_lora(self, log_dir: Path, state_dict: dict[str, torch.Tensor] | None = None) -> tuple[Path, Path]:
        """Write the adapter (``PeftModel.save_pretrained``) to ``<log_dir>/hf_adapter`` and the merged model
        (``merge_and_unload`` on a CPU copy of the base from ``model.model_path``) to ``<log_dir>/hf``, each with
        the tokenizer. ``state_dict``: the policy's gathered full weights (sharded runs)."""
        from rlflow.models.lora import export_adapter, export_merged

        hp = self.hparams
        adapter_dir = export_adapter(self.peft_model, log_dir / "hf_adapter", state_dict)
        base = load_causal_lm(hp.model_path, hp.dtype, hp.attn_implementation)
        merged_dir = export_merged(base, adapter_dir, log_dir / "hf")
        for out in (adapter_dir, merged_dir):
            self.text_processor.save_pretrained(out)
        info(f"exported the LoRA adapter to {adapter_dir} and the merged policy to {merged_dir}")
        return adapter_dir, merged_dir
