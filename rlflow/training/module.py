"""``GRPOModule``: the policy (and, with a KL term, a frozen reference) and one GRPO step, top to bottom.

One ``training_step`` is one rollout step: ask the datamodule for fresh experience sampled from the current
weights, compute old and reference log-probs where they are needed, then take ``model.update.optimizer_steps``
optimizer steps over shuffled mini-batches, each accumulated over micro-batches (manual optimization).
Lightning's ``global_step`` counts rollout steps, not optimizer steps (:mod:`rlflow.training.step_unit`). Metrics
use TRL's names so dashboards compare.

The settings come in groups (:mod:`rlflow.training.settings`: ``model.optim``, ``model.update``,
``model.reference``, ``model.rollout_correction``, ``model.policy``), beside ``model.lora``. The loss owns its
hyper-parameters (``model.loss.init_args``); a reference model is loaded iff the loss has ``kl_coef > 0`` (with
``model.lora`` the reference is the policy with its adapters disabled, :mod:`rlflow.models.lora`). The sampling
temperature (that the log-probs are computed at) and the completion budget (of the loss normalisers) are the
datamodule's ``data.sampling``, read through the :class:`~rlflow.data.protocol.ExperienceSource`.

The models are built by :mod:`rlflow.models.loading`, exported by :mod:`rlflow.training.export`; what a checkpoint
holds besides the weights is :mod:`rlflow.training.resume`'s.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch

from rlflow import registry
from rlflow.config_error import ConfigError
from rlflow.data.experience import Experience, collate
from rlflow.data.protocol import ExperienceSource
from rlflow.log import info, warn
from rlflow.losses.base import LossContext, PolicyLoss, masked_mean
from rlflow.models.loading import build_models
from rlflow.models.lora import LoraSettings
from rlflow.models.model_path import check_model_path
from rlflow.models.moe import collect_router_logits, router_settings
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
from rlflow.training.export import PolicyExport
from rlflow.training.host_memory import reuse_freed_memory
from rlflow.training.logprobs import completion_logprobs
from rlflow.training.memory_metrics import memory_metrics, reset_peaks
from rlflow.training.optim import UpdateFraction, build_lr_scheduler, build_optimizer, clip_grad_norm
from rlflow.training.packing import (
    balance_pack_count,
    collate_packed,
    pack_experiences,
    packed_completion_logprobs,
    varlen_supported,
)
from rlflow.training.packing_support import resolve_packing
from rlflow.training.reference import sync_reference
from rlflow.training.resume import ResumeState, checkpoint_state, loadable_state
from rlflow.training.settings import (
    ModuleSettings,
    OptimSettings,
    PolicySettings,
    ReferenceSettings,
    RolloutCorrectionSettings,
    UpdateSettings,
)
from rlflow.training.step_unit import count_rollout_step, optimizer_step
from rlflow.training.zero_advantage import check_skip, skip_passes


class NonFiniteLossError(RuntimeError):
    """Too many optimizer steps in a row had a NaN or infinite loss or gradient."""


def emulated_bf16(precision: str, device: torch.device, policy_dtype: torch.dtype = torch.float32,
                  fsdp_param_dtype: torch.dtype | None = None) -> str | None:
    """Why ``trainer.precision``, the policy's parameter dtype or FSDP2's mixed-precision compute dtype
    (``fsdp_param_dtype``: ``fsdp2_bf16``) costs time on ``device``, or None: bf16 compute on a CPU whose bf16
    matrix products are slower than float32's, emulated in software (neither AMX nor AVX512-BF16) or measured slower
    (:func:`rlflow.rollout.hardware.cpu_bf16_speedup` < 1: AVX512-BF16 without AMX), where a run is faster in
    32-true (``trainer.precision: auto`` picks that there, :mod:`rlflow.training.trainer`) with float32 parameters."""
    from rlflow.rollout.hardware import cpu_bf16_speedup, native_bf16

    if device.type != "cpu":
        return None
    if native_bf16(device):
        speedup = cpu_bf16_speedup()
        if speedup >= 1.0:
            return None
        where, why = "on this CPU", f"its bf16 matrix products measure {speedup:.2f}x float32's here"
    else:
        where = "on a CPU without bf16 hardware (no AMX or AVX512-BF16)"
        why = "its bf16 matrix products are emulated, several times slower than float32"
    if precision.startswith("bf16"):
        return (f"trainer.precision={precision} {where}: {why}; set --trainer.precision 32-true (or auto: bf16 only "
                "where it is faster)")
    if policy_dtype == torch.bfloat16:
        return (f"model.policy.dtype=bfloat16 {where}: {why}; keep float32 parameters (the engine's dtype: auto "
                "decodes rollouts through float32 copies either way)")
    if fsdp_param_dtype == torch.bfloat16:
        return (f"an FSDP2 strategy computing in bfloat16 (fsdp2_bf16, param_dtype=bfloat16) {where}: {why}; set "
                "--trainer.strategy fsdp2 (float32 compute)")
    return None


def warn_plain_checkpoints(callbacks: list[Any]) -> None:
    """Lightning's own ``ModelCheckpoint`` (a ``lightning.Trainer``'s default) saves at epoch ends, between rollout
    steps' bookkeeping: a run resumed from it does not continue the same prompt order. ``rlflow fit`` puts
    :class:`~rlflow.training.checkpointing.RLFlowCheckpoint` in its place; a script is told to."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from rlflow.training.checkpointing import RLFlowCheckpoint

    if any(type(c) is ModelCheckpoint for c in callbacks) and not any(isinstance(c, RLFlowCheckpoint)
                                                                        for c in callbacks):
        warn("the trainer checkpoints with Lightning's ModelCheckpoint, whose checkpoints do not resume a GRPO run "
             "exactly (the prompt order restarts); pass callbacks=[rlflow.training.checkpointing.RLFlowCheckpoint()]"
             " (or enable_checkpointing=False)")


def plain_plugin(plugin: Any) -> Any:
    """A plugin argument as checkpoints hold it: a name or mapping as given, an object (the Python API's
    ``loss=BNPOLoss(...)``) as ``{class_path, init_args}`` of its constructor arguments it keeps as attributes of
    the same name. A checkpoint then holds plain values only, which ``torch.load(weights_only=True)`` reads."""
    if plugin is None or isinstance(plugin, (str, dict)):
        return plugin
    cls = type(plugin)
    try:
        names = list(registry.init_defaults(cls)[0])  # **kwargs followed up the classes, as jsonargparse does
    except (TypeError, ValueError):
        names = []
    kept = {n: getattr(plugin, n, plain_plugin) for n in names}  # the function itself: "no such attribute"
    init_args = {n: value for n, value in kept.items() if isinstance(value, PLAIN)}
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": init_args}


PLAIN = (str, int, float, bool, type(None))


def as_lists(value: Any) -> Any:
    """``value`` with every tuple a list, at any depth (``yaml.safe_load`` reads no ``!!python/tuple``)."""
    if isinstance(value, dict):
        return {k: as_lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_lists(v) for v in value]
    return value


def build_loss(loss: Any) -> Any:
    """The loss object of ``model.loss``: a short name, an import path, a ``class_path``/``init_args`` mapping, or
    an object (what jsonargparse instantiates), which is returned as it is. Its hyper-parameters are its own."""
    return registry.build("rlflow.losses", loss)


def build_correction(settings: RolloutCorrectionSettings, loss_fn: Any) -> RolloutCorrection | None:
    """The correction ``model.rollout_correction`` asks for (None: off), checked against the loss."""
    if not settings.on:
        return None
    correction = RolloutCorrection(settings.mode, settings.cap, settings.min)
    if correction.sequence_level and getattr(loss_fn, "own_importance_weights", False):
        raise ConfigError(f"model.loss={type(loss_fn).__name__} folds token-level rollout correction weights into "
                          f"its own sequence weight; model.rollout_correction.mode={settings.mode} is "
                          "sequence-level: use token_truncate or token_mask")
    return correction


#: What every rollout step logs besides the loss's and the updates' metrics (:meth:`GRPOModule.training_step`).
STEP_METRICS = ("num_tokens", "train/skipped_steps", "lr", "step_time")


def warn_taken_names(rollout_metrics: dict[str, float], training_names: list[str], warned: set[str]) -> None:
    """Warn, once per name and run, about a rollout-step metric (a judger's ``log_metric``: rlflow's own rollout
    metrics are named apart) that a training metric of the same name replaces in the logs."""
    for name in sorted(set(rollout_metrics) & set(training_names) - warned):
        warned.add(name)
        warn(f"a judger's log_metric({name!r}, ...) is not logged: {name!r} is a training metric; give it another "
             "name")


def loss_tokens(loss_fn: Any, experiences: list[Experience]) -> int:
    """Completion tokens the loss trains on (without truncated completions where the loss masks them)."""
    skip = getattr(loss_fn, "mask_truncated_completions", False)
    return sum(e.num_sampled for e in experiences if not (skip and e.truncated))


def all_cores(trainer: Any) -> contextlib.AbstractContextManager:
    """The experience source's context for the backward pass (:meth:`ExperienceSource.all_cores`: pipelined on a
    CPU, the generator process's cores lent to it); as it is where no datamodule is attached."""
    source = trainer.datamodule if trainer is not None else None
    return source.all_cores() if source is not None else contextlib.nullcontext()


def reduce_sum(trainer: Any, values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``values`` summed over ranks (itself on one)."""
    if trainer is None or trainer.world_size == 1:
        return values
    return trainer.strategy.reduce(values.to(device), reduce_op="sum").cpu()


def global_counts(trainer: Any, values: list[int], device: torch.device) -> list[int]:
    """``values`` summed over ranks: the batch sizes the loss normalisers divide by."""
    if trainer is None or trainer.world_size == 1:
        return [int(v) for v in values]
    summed = trainer.strategy.reduce(torch.tensor(values, dtype=torch.long, device=device), reduce_op="sum")
    return [int(v) for v in summed.tolist()]


def pipelined_correction(settings: ModuleSettings, correction: Any, max_staleness: int) -> Any:
    """With ``data.pipeline.max_staleness > 0`` (:mod:`rlflow.rollout.pipeline`): the bound must admit the
    one-step pipeline's staleness, and the importance-sampling correction is on (``token_truncate`` against the
    generator's log-probs) unless ``model.rollout_correction.mode: off``. The correction to use."""
    update, config = settings.update, settings.rollout_correction
    per_step = update.optimizer_steps * update.num_iterations
    if max_staleness < per_step:
        raise ConfigError(
            f"data.pipeline.max_staleness={max_staleness} is below the pipeline's staleness of {per_step} policy "
            f"versions (model.update.optimizer_steps={update.optimizer_steps} x model.update.num_iterations="
            f"{update.num_iterations}): every batch would be stale; set data.pipeline.max_staleness >= {per_step} "
            "or 0")
    if correction is None and config.mode != "off":
        correction = RolloutCorrection("token_truncate", config.cap, config.min)
        info(f"data.pipeline.max_staleness={max_staleness}: rollout importance-sampling correction token_truncate "
             f"(cap {config.cap}) against the generator's log-probs; model.rollout_correction.mode=off disables it")
    return correction


def shard_models(strategy: Any, models: list[torch.nn.Module | None]) -> None:
    """``fully_shard`` each model (FSDP2), layer by layer, then the root, with the strategy's options."""
    mesh = data_parallel_mesh(strategy)
    options = {}
    if isinstance(strategy, FSDP2Strategy):
        options = dict(mp_policy=strategy.mp_policy(), offload_policy=strategy.offload_policy(),
                       reshard_after_forward=strategy.reshard_after_forward)
    for model in models:
        if model is not None:
            shard_model(model, mesh, **options)


def policy_loss(
    loss_fn: Any, correction: RolloutCorrection | None, micro: list[Experience], batch: dict[str, torch.Tensor],
    logprobs: torch.Tensor, entropy: torch.Tensor, ctx: LossContext, is_tokens: list | None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The policy loss of one micro-batch and its metrics: against the old log-probs (the detached training
    forward's where none were fixed before the update), the reference's where there is one, with the rollout
    correction's weights (their tokens added to ``is_tokens`` where that is a list)."""
    mask = batch["completion_mask"]
    old = batch["old_logprobs"] if micro[0].old_logprobs is not None else logprobs.detach()
    ref = batch["ref_logprobs"] if micro[0].ref_logprobs is not None else None
    is_weights = None
    if correction is not None:
        is_weights = correction.weights(old, batch["rollout_logprobs"], mask)
        if is_tokens is not None:
            is_tokens.append((old[mask].float().cpu(), batch["rollout_logprobs"][mask].float().cpu()))
    return loss_fn(logprobs, old, batch["advantages"], mask, ref_logprobs=ref,
                   rollout_logprobs=batch["rollout_logprobs"], entropy=entropy, truncated=batch["truncated"],
                   rollout_is_weights=is_weights, ctx=ctx)


class PolicyUpdate:
    """The optimizer steps of one rollout step of a :class:`GRPOModule` (``module.updater``, called with the
    module): each over a mini-batch, accumulated over micro-batches (the policy's forward, the loss with the
    rollout correction's weights and an MoE policy's load-balancing loss, the backward), then gradient clipping,
    the optimizer and learning-rate steps. A step whose loss or gradient is not finite is skipped; too many in a
    row stop the run (:class:`NonFiniteLossError`)."""

    def __init__(self) -> None:
        #: The (old, rollout) log-probs of the step's completion tokens, collected from the training forwards
        #: where the rollout correction's metrics come from them (``module.correction_in_forward``), else None.
        self.is_tokens: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def run(self, module: GRPOModule, minibatches: list[list[Experience]]) -> dict[str, float]:
        """``model.update.num_iterations`` passes (GRPO's mu) over the mini-batches, one optimizer step each (the
        old log-probs fixed before them); the sums of the steps' metrics. Only the last step counts in
        ``trainer.global_step`` (:mod:`rlflow.training.step_unit`), and the rollout step counts even if it was
        skipped."""
        everything = [e for mb in minibatches for e in mb]
        generation_seqs, generation_tokens = global_counts(
            module._trainer, [len(everything), loss_tokens(module.loss_fn, everything)], module.device)
        self.is_tokens = [] if module.correction_in_forward else None
        sums: dict[str, float] = {}
        rollout_step = module.global_step
        updates = [mb for _ in range(module.settings.update.num_iterations) for mb in minibatches]
        for i, minibatch in enumerate(updates):
            sums = self.step(module, minibatch, generation_tokens, generation_seqs, sums, count=i == len(updates) - 1)
        if module.global_step == rollout_step:  # that step was skipped: the rollout step counts all the same
            count_rollout_step(module.optimizers())
        return sums

    def correction_metrics(self, correction: RolloutCorrection | None) -> dict[str, float]:
        """The rollout correction's metrics of the weights from the training forwards (``correction_in_forward``;
        empty otherwise)."""
        tokens, self.is_tokens = self.is_tokens, None
        if not tokens:
            return {}
        old_t, rollout_t = (torch.cat(parts) for parts in zip(*tokens))
        return correction.metrics(old_t, rollout_t, torch.ones_like(old_t, dtype=torch.bool))

    def step(
        self, module: GRPOModule, minibatch: list[Experience], generation_tokens: int, generation_seqs: int,
        sums: dict, count: bool = True,
    ) -> dict:
        """One optimizer step over ``minibatch``, accumulated over micro-batches; adds its metrics to ``sums``.

        ``count``: whether the step advances ``trainer.global_step`` (one per rollout step, see
        :mod:`rlflow.training.step_unit`).
        """
        opt = module.optimizers()
        sched = module.lr_schedulers()
        module.trained_versions.append((module.policy_version, max(e.policy_version for e in minibatch)))
        mini_seqs, mini_tokens = global_counts(
            module._trainer, [len(minibatch), loss_tokens(module.loss_fn, minibatch)], module.device)
        ctx = LossContext(mini_batch_sequences=mini_seqs, mini_batch_tokens=mini_tokens,
                          generation_batch_sequences=generation_seqs, generation_batch_tokens=generation_tokens,
                          max_tokens=module.experience.sampling.max_tokens, world_size=module.trainer.world_size)
        opt.zero_grad(set_to_none=True)
        step: dict[str, float] = {}
        finite = True
        if module.settings.update.skip_zero_advantage:  # sequences whose gradient is zero: a forward pass only
            passes, forward_only = skip_passes(module, minibatch)
        else:
            passes, forward_only = module.micro_batches(minibatch), []
        for micro in passes:
            if micro is None:  # another rank's pass
                self.null_pass(module, minibatch[:1], backward=True)
            elif not self.micro_step(module, micro, len(minibatch), ctx, step):
                finite = False
                if world_size() == 1:
                    break
        grad_norm = torch.tensor(0.0)
        if world_size() > 1:
            finite = all_true(finite)
        if finite:
            with torch.no_grad():
                for micro in forward_only:
                    if micro is None:
                        self.null_pass(module, minibatch[:1], backward=False)
                    else:
                        self.micro_step(module, micro, len(minibatch), ctx, step, backward=False)
            grad_norm = module.clip_gradients_and_norm(module.settings.optim.max_grad_norm)
            finite = bool(torch.isfinite(grad_norm))
        if not finite:
            module.loss_fn.on_skipped_step()
            self.skip(module, opt)
            return sums
        module.consecutive_skips = 0
        module.update_fraction.before_step()
        optimizer_step(module.trainer, opt, count)
        sched.step()
        reduce = functools.partial(reduce_sum, module._trainer, device=module.device)
        step.update(module.loss_fn.on_optimizer_step(reduce))  # a loss's own state (adaptive entropy)
        fraction = module.update_fraction.after_step(module.policy_version)
        if fraction is not None:
            step["optim/update_fraction"] = fraction
        module.policy_version += 1
        module.experience.sync_weights()
        step["grad_norm"] = float(grad_norm)
        for key, value in step.items():
            sums[key] = sums.get(key, 0.0) + value
        return sums

    def micro_step(
        self, module: GRPOModule, micro: list[Experience], minibatch_size: int, ctx: LossContext, step: dict,
        backward: bool = True,
    ) -> bool:
        """The forward and backward of one micro-batch, its metrics added to ``step``; False (and no backward, or
        a zero one that keeps FSDP's collectives in step with the other ranks) where its loss is not finite.
        ``backward`` False: the forward and the metrics only (sequences whose gradient is zero,
        :mod:`rlflow.training.zero_advantage`)."""
        routers = collect_router_logits(module.policy) if module.router_aux else contextlib.nullcontext()
        with routers as caught:  # an MoE policy's router logits, for its load-balancing loss
            logprobs, entropy, batch = module.logprobs_of(module.policy, micro)
        loss, loss_metrics = policy_loss(module.loss_fn, module.correction, micro, batch, logprobs, entropy, ctx,
                                         self.is_tokens)
        mask = batch["completion_mask"]
        if caught is not None:
            aux = caught.aux_loss()
            loss = loss + module.router_aux * aux.to(loss.device)
            loss_metrics["aux_loss"] = float(aux.detach())
        if getattr(module.loss_fn, "mask_truncated_completions", False):  # the weight counts the loss's tokens
            mask = mask & ~batch["truncated"].unsqueeze(1)
        weight = module.loss_fn.micro_batch_weight(mask, ctx)
        if not torch.isfinite(loss):
            if world_size() > 1:
                module.manual_backward(logprobs.sum() * 0.0)  # keep FSDP's gradient collectives in step with the ranks
            return False
        if backward:
            with all_cores(module._trainer):
                module.manual_backward(loss * weight)
        share = len(micro) / minibatch_size  # metrics: a sequence-weighted mean over the micro-batches
        loss_metrics["entropy"] = masked_mean(entropy.detach(), batch["completion_mask"]).item()
        for key, value in loss_metrics.items():
            step[key] = step.get(key, 0.0) + share * float(value)
        step["loss"] = step.get("loss", 0.0) + weight * loss.item() / max(module.trainer.world_size, 1)
        return True

    @staticmethod
    def null_pass(module: GRPOModule, micro: list[Experience], backward: bool) -> None:
        """A pass that changes nothing (no metrics; with ``backward``, a zero loss's): it joins the collectives of
        a pass another rank runs (:func:`rlflow.training.zero_advantage.skip_passes`)."""
        logprobs = module.logprobs_of(module.policy, micro)[0]
        if backward:
            module.manual_backward(logprobs.sum() * 0.0)

    def skip(self, module: GRPOModule, opt: Any) -> None:
        """Drop this optimizer step's gradients; stop the run after too many non-finite steps in a row."""
        opt.zero_grad(set_to_none=True)
        module.skipped_steps += 1
        module.consecutive_skips += 1
        info(f"rollout step {module.global_step}: non-finite loss or gradient, optimizer step skipped "
             f"({module.consecutive_skips} in a row, {module.skipped_steps} in all)")
        limit = module.settings.update.max_consecutive_skipped_steps
        if module.consecutive_skips >= limit:
            raise NonFiniteLossError(
                f"{module.consecutive_skips} optimizer steps in a row had a NaN or infinite loss or gradient "
                f"(model.update.max_consecutive_skipped_steps={limit}); lower model.optim.lr, set "
                "model.optim.max_grad_norm, or use model.policy.dtype=float32. Checkpoints written so far are intact."
            )


@dataclass
class OutsideModels:
    """The models a :class:`GRPOModule` keeps out of its module tree, so that neither its ``state_dict`` nor
    ``.to()`` reach them: the fixed KL reference (it never changes: checkpoints need not hold it) and PEFT's
    wrapper of the policy (the policy itself is the module that runs and is checkpointed)."""

    reference: torch.nn.Module | None = None
    peft: Any = None


class GRPOModule(L.LightningModule):
    """Owns the policy and reference models and runs the GRPO update."""

    def __init__(
        self,
        model_path: str,
        loss: str | PolicyLoss = "bnpo",
        optim: OptimSettings = OptimSettings(),  # noqa: B008 (frozen: a shared default is safe)
        update: UpdateSettings = UpdateSettings(),  # noqa: B008
        reference: ReferenceSettings = ReferenceSettings(),  # noqa: B008
        rollout_correction: RolloutCorrectionSettings = RolloutCorrectionSettings(),  # noqa: B008
        policy: PolicySettings = PolicySettings(),  # noqa: B008
        lora: LoraSettings | None = None,
        export_hf: bool = True,
    ) -> None:
        """
        Args:
            model_path: Policy to train: a local Hugging Face model directory (or a hub id where the hub is reachable).
            loss: Policy loss: a short name of the ``rlflow.losses`` group (``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``,
                ``gspo``, ``luspo``, ``cispo``, ``sapo``, ``vespo``, or a plugin's), an import path, or
                ``class_path``/``init_args`` (``--model.loss.help grpo`` lists a loss's options). The loss owns its
                hyper-parameters (``epsilon_low``, ``epsilon_high``, ``kl_coef``, ``kl_type``...); a reference model
                is loaded iff its ``kl_coef`` is > 0.
            optim: The optimizer and its learning-rate schedule.
            update: How one rollout step's experience becomes optimizer steps (mini-batches, micro-batches, packing).
            reference: The KL reference: its model and whether it moves toward the policy.
            rollout_correction: Importance sampling between the rollout engine's and the trainer's log-probs.
            policy: How the policy model is loaded and run (dtype, attention, memory savers).
            lora: Train PEFT LoRA adapters instead of the full weights (``r``, ``alpha``, ``dropout``,
                ``target_modules``, any other ``peft.LoraConfig`` field in ``options``; ``pip install
                'rlflow[lora]'``). Only the adapters train and are checkpointed; the KL reference is the same model
                with its adapters disabled. None (the default): full fine-tuning.
            export_hf: At the end of ``fit``, write the policy and tokenizer with ``save_pretrained`` to
                ``<log_dir>/hf`` (with ``lora``: the merged model there, the adapter in ``<log_dir>/hf_adapter``);
                ``rlflow export`` writes the same from any checkpoint.
        """
        super().__init__()
        self.settings = ModuleSettings.of(model_path, lora, export_hf, optim=optim, update=update, reference=reference,
                                          rollout_correction=rollout_correction, policy=policy)
        if self.lora is not None:
            self.lora.peft_config()  # PEFT installed and the options valid: fail now, not after loading the model
        self.save_hyperparameters()
        plain = {**self.settings.hparams(), "loss": plain_plugin(self.hparams.get("loss", loss))}  # plain data in
        # checkpoints and logs (rlflow fit's hparams hold the loss as its config mapping already)
        self.hparams.update(plain)
        self._hparams_initial.update(as_lists(plain))  # what loggers write (hparams.yaml): YAML without tags
        self.automatic_optimization = False
        check_model_path(model_path, "model.model_path")  # before anything slow: a wrong path fails in a second
        if self.settings.reference.path is not None:
            check_model_path(self.settings.reference.path, "model.reference.path")
        self.loss_fn = build_loss(loss)
        self.settings.reference.check_use(self.uses_reference, self.lora is not None)
        self.correction = build_correction(self.settings.rollout_correction, self.loss_fn)
        if self.settings.update.skip_zero_advantage:  # the loss now; the policy at fit start
            check_skip(self.loss_fn, moe=False)
        self.policy: torch.nn.Module | None = None
        self.outside = OutsideModels()
        self.resume = ResumeState()
        # checkpointed (rlflow.training.resume.COUNTERS)
        self.policy_version = 0  # optimizer steps taken: the version of the weights that sample next
        self.num_tokens = 0.0  # TRL's cumulative prompt + completion tokens
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.trained_versions: list[tuple[int, int]] = []  # (policy_version at the update, versions sampled)
        self.packing_checked: bool | None = None  # model.update.packing after the check at fit start (None: not yet)
        self.vision: Any = None  # rlflow.models.vision.VisionBatches for a vision-language policy
        self.router_aux = 0.0  # the MoE load-balancing loss's weight, set when the policy is loaded
        self.correction_in_forward = False  # pipelined, one update per rollout step: IS weights from its forward
        self.updater = PolicyUpdate()
        self.loaded_step: int | None = None  # the global step of the checkpoint whose weights were loaded
        self.warned_names: set[str] = set()  # judgers' metric names a training metric replaces, warned about

    # --------------------------------------------------------------------------------------------- models
    @property
    def lora(self) -> LoraSettings | None:
        return self.settings.lora

    @property
    def uses_reference(self) -> bool:
        """Whether the loss has a KL term, so a frozen reference is loaded (its ``kl_coef`` is the one switch)."""
        return float(getattr(self.loss_fn, "kl_coef", 0.0) or 0.0) > 0.0

    @property
    def ref_model(self) -> torch.nn.Module | None:
        """The frozen reference. Kept out of ``state_dict`` (it never changes, so checkpoints need not hold it),
        unless ``model.reference.sync_steps`` moves it: then it is the submodule ``reference``, checkpointed."""
        fixed = self.outside.reference
        return fixed if fixed is not None else self._modules.get("reference")

    @property
    def peft_model(self) -> Any:
        """PEFT's wrapper of the policy under ``model.lora`` (None otherwise); kept out of the module tree, the
        policy itself being the model that runs (:mod:`rlflow.models.lora`)."""
        return self.outside.peft

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        s = self.settings
        models = build_models(s.model_path, s.policy, s.reference, s.lora, self.uses_reference)
        self.policy, self.vision, self.router_aux = models.policy, models.vision, models.router_aux
        self.outside = OutsideModels(reference=models.reference, peft=models.peft)
        if models.reference is not None and s.reference.sync_steps:  # it will move: checkpointed with the policy
            self.adopt_reference()
        if self.sharded:  # trainer.strategy=fsdp: the policy and the reference, FSDP2-sharded alike
            shard_models(self.trainer.strategy, [self.policy, self.ref_model])

    def adopt_reference(self) -> None:
        """Make the fixed reference the submodule ``reference`` (checkpointed from now on): it moves
        (:mod:`rlflow.training.reference`). In train mode like the rest of the module; its forwards switch to eval."""
        self.reference = self.outside.reference.train()
        self.outside.reference = None

    @property
    def sharded(self) -> bool:
        """Whether the models are FSDP2-sharded (the trainer's strategy is a ``ModelParallelStrategy``)."""
        return self._trainer is not None and is_sharded(self.trainer.strategy)

    def on_fit_start(self) -> None:
        if self.ref_model is not None and not self.sharded:  # a sharded reference already sits on its devices
            self.ref_model.to(self.device)
        slow = emulated_bf16(str(self.trainer.precision), self.device, next(self.policy.parameters()).dtype,
                             getattr(self.trainer.strategy, "param_dtype", None))
        if slow:
            warn(slow)
        self.experience.bind(self.policy, self.current_policy_version)
        warn_plain_checkpoints(self.trainer.callbacks)
        self.check_pipelining(self.experience.max_staleness)
        update = self.settings.update
        if update.skip_zero_advantage:
            check_skip(self.loss_fn, moe=router_settings(self.policy) is not None)
        reuse_freed_memory(update.reuse_freed_memory, self.device)
        self.packing_checked = resolve_packing(update.packing, [self.policy, self.ref_model], self.sharded,
                                               update.pack_max_length)

    def check_pipelining(self, max_staleness: int) -> None:
        """Pipelined generation (:func:`pipelined_correction`)."""
        if not max_staleness:
            return
        self.correction = pipelined_correction(self.settings, self.correction, max_staleness)
        per_step = self.settings.update.optimizer_steps * self.settings.update.num_iterations
        # one update per rollout step: the training forward's own log-probs are the weights at the step's start,
        # so the token IS weights come from it, without a separate old-log-prob pass
        self.correction_in_forward = bool(self.correction) and per_step == 1 and not self.correction.sequence_level

    @property
    def packing(self) -> bool:
        """Whether micro-batches are packs: ``model.update.packing`` as checked at fit start (as configured before
        it)."""
        return self.packing_checked if self.packing_checked is not None else self.settings.update.packing

    def on_validation_start(self) -> None:
        self.experience.bind(self.policy, self.current_policy_version)

    def current_policy_version(self) -> int:
        """Optimizer steps taken so far: the version of the weights that sample next (the rollout pipeline asks it
        mid-generation for partial rollouts)."""
        return self.policy_version

    def configure_optimizers(self) -> Any:
        optim, update = self.settings.optim, self.settings.update
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = build_optimizer(optim.optimizer, params, optim.lr, optim.betas, optim.weight_decay)
        # the trainer counts rollout steps (training_step calls); the schedule counts optimizer steps
        rollout_steps = max(int(self.trainer.estimated_stepping_batches), 1) if self._trainer is not None else 1
        total = rollout_steps * update.optimizer_steps * update.num_iterations
        self.lr_schedule_steps = total  # checkpointed: a run continued with another max_steps re-spans the schedule
        scheduler = build_lr_scheduler(optimizer, optim.lr_schedule, optim.warmup_steps, total)
        self.update_fraction = UpdateFraction(params, optim.optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------------------------------ log-probs
    def micro_batches(self, experiences: list[Experience], balance: bool = True) -> list[list[Experience]]:
        """Split into micro-batches: token-budget packs with ``packing``, else ``micro_batch_size`` sequences.

        Sharded, every rank splits its packs until all have as many as the rank with the most: each micro-batch
        is an FSDP2 forward (and backward), collectives every rank must join. (Padded micro-batches need no such
        step: every rank holds the same number of sequences.) ``balance`` False leaves that to the caller.
        """
        update = self.settings.update
        if self.packing:
            share = varlen_supported(self.policy)
            packs = pack_experiences(experiences, update.pack_max_length, share_prompts=share)
            return balance_pack_count(packs, all_max(len(packs))) if self.sharded and balance else packs
        mb = update.micro_batch_size
        return [experiences[start: start + mb] for start in range(0, len(experiences), mb)]

    def logprobs_of(
        self, model: torch.nn.Module, experiences: list[Experience]
    ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """``model``'s log-probs and entropies of the completions, at the sampling temperature, and the batch."""
        temperature, chunk = self.experience.sampling.temperature, self.settings.update.logprob_chunk_size
        if self.packing:
            packed = collate_packed(experiences, share_prompts=varlen_supported(model))  # a group's prompt once
            batch = {k: v.to(self.device) for k, v in packed.items()}
            logprobs, entropy = packed_completion_logprobs(model, batch, temperature, chunk, sharded=self.sharded)
            return logprobs, entropy, batch
        batch = collate(experiences, self.pad_id)
        if self.vision is not None:  # each sequence's images in context (rlflow.models.vision)
            batch = self.vision.add_inputs(batch, experiences, self.pad_id)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        stats = sharded_completion_logprobs if self.sharded else completion_logprobs
        logprobs, entropy = stats(model, batch, temperature, chunk)
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

    def fix_logprobs(self, experiences: list[Experience], metrics: dict[str, float]) -> None:
        """Before any update: the old log-probs (the ratio's denominator, needed once later updates are
        off-policy, or to compare with the rollout engine's log-probs) and the reference log-probs, with the
        rollout correction's metrics where the old ones are computed for it."""
        update = self.settings.update
        separate_old = self.correction is not None and not self.correction_in_forward
        if update.optimizer_steps > 1 or update.num_iterations > 1 or separate_old:
            self.fill_logprobs(experiences, "old_logprobs", self.policy)
        if self.ref_model is not None:
            self.fill_logprobs(experiences, "ref_logprobs", self.ref_model)
        elif self.uses_reference and self.peft_model is not None:  # the same model with its adapters disabled
            from rlflow.models.lora import adapters_disabled

            with adapters_disabled(self.peft_model):
                self.fill_logprobs(experiences, "ref_logprobs", self.policy)
        if separate_old:
            batch_all = collate(experiences, self.pad_id)
            metrics.update(self.correction.metrics(
                batch_all["old_logprobs"], batch_all["rollout_logprobs"], batch_all["completion_mask"]))

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
        reset_peaks(self.device)
        update = self.settings.update
        # 1. generate k completions per prompt with the current weights, judge them, compute group advantages
        with full_weights(self.policy if self.experience.reads_policy_weights else None):
            rollout = self.experience.make_experience(batch, policy_version=self.policy_version, step=self.global_step)
        minibatches = self.experience.minibatches(update.optimizer_steps)
        everything = [e for mb in minibatches for e in mb]
        # 2. the old and reference log-probs, fixed before any update
        trained: dict[str, float] = {}
        self.fix_logprobs(everything, trained)
        # 3. num_iterations passes (GRPO's mu) over optimizer_steps mini-batches, one optimizer step each
        rollout_step = self.global_step
        sums = self.updater.run(self, minibatches)
        self.maybe_sync_reference(rollout_step + 1)
        trained.update(self.updater.correction_metrics(self.correction))
        # 4. metrics: global values under data parallelism; "loss" is each rank's share, so it adds up
        n = len(minibatches) * update.num_iterations
        trained.update({key: value / n for key, value in sums.items()})
        trained.update(memory_metrics(self.device))
        warn_taken_names(rollout.metrics, [*trained, *STEP_METRICS], self.warned_names)
        metrics = reduce_metrics({**rollout.metrics, **trained}, samples_per_rank=len(everything), sum_keys={"loss"})
        self.num_tokens += metrics.pop("num_prompt_tokens") + metrics.pop("num_completion_tokens")
        metrics["num_tokens"] = self.num_tokens
        metrics["train/skipped_steps"] = float(self.skipped_steps)
        metrics["lr"] = float(self.optimizers().param_groups[0]["lr"])  # a tensor in torchao's optimizers
        metrics["step_time"] = time.perf_counter() - start
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(everything))
        self.last_metrics = metrics
        self.last_rollout = rollout

    def maybe_sync_reference(self, rollout_steps_done: int) -> None:
        """After every ``model.reference.sync_steps``-th rollout step, move the reference toward the policy
        (:func:`rlflow.training.reference.sync_reference`; every rank its own shards)."""
        every, alpha = self.settings.reference.sync_steps, self.settings.reference.mixup_alpha
        if not every or rollout_steps_done % every or self.ref_model is None:
            return
        sync_reference(self.ref_model, self.policy, alpha)
        info(f"rollout step {rollout_steps_done - 1}: the KL reference moved toward the policy "
             f"(model.reference.mixup_alpha={alpha})")

    def clip_gradients_and_norm(self, max_norm: float | None) -> torch.Tensor:
        params = [p for p in self.policy.parameters() if p.grad is not None]
        if not params:
            return torch.tensor(0.0)
        if self.sharded:  # DTensor gradients: the norm over every rank's shards
            return full_tensor(torch.nn.utils.clip_grad_norm_(params, math.inf if max_norm is None else max_norm))
        if max_norm is None:
            return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        return clip_grad_norm(params, max_norm)

    # ---------------------------------------------------------------------------------------- evaluation
    def on_validation_epoch_start(self) -> None:
        self.eval_metrics = EvalMetrics(self.experience.eval_k, self.experience.eval_data_sources).to(self.device)

    def validation_step(self, batch: list, batch_idx: int) -> dict[str, Any]:
        """Generate and judge the batch's eval samples, add them to the eval metrics, and return their rows
        (``{"samples": [...]}``, which :class:`rlflow.training.callbacks.TrajectoryWriter` and ``SampleTable`` read)."""
        with full_weights(self.policy if self.experience.reads_policy_weights else None):
            out = self.experience.evaluate(batch, step=self.trained_steps, batch_idx=batch_idx)
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
        """Under ``model.lora`` without the frozen base weights (:func:`rlflow.training.resume.checkpoint_state`)."""
        state = super().state_dict(*args, **kwargs)
        if args or kwargs.get("destination") is not None:
            return state
        return checkpoint_state(self, state, kwargs.get("prefix", ""))

    def load_state_dict(self, state_dict: Any, strict: bool = True, **kwargs: Any) -> Any:
        """A checkpoint's weights, completed as :func:`rlflow.training.resume.loadable_state` says (LoRA's base
        weights, a moved KL reference)."""
        state_dict = loadable_state(self, state_dict, lambda: super(GRPOModule, self).state_dict())
        return super().load_state_dict(state_dict, strict=strict, **kwargs)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.resume.save(self, checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded_step = int(checkpoint.get("global_step", 0))
        self.resume.load(self, checkpoint)

    @property
    def trained_steps(self) -> int:
        """Rollout steps the policy has been trained: the trainer's count, or where ``rlflow validate --ckpt_path``
        loaded only the weights (the trainer counts from 0), the checkpoint's. Evaluation seeds its sampling
        with it, so the same weights get the same score in ``fit`` and in ``validate``."""
        fitting = self._trainer is not None and self.trainer.state.fn == "fit"
        return self.global_step if fitting or self.loaded_step is None else self.loaded_step

    def on_train_start(self) -> None:
        self.resume.on_train_start(self)

    def on_fit_end(self) -> None:
        """``model.export_hf``: the policy's HF export to the log directory (:mod:`rlflow.training.export`)."""
        if not self.settings.export_hf:
            return
        log_dir = self.trainer.log_dir  # read on every rank: it is a broadcast under a distributed strategy
        state_dict = gather_full_state_dict(self.policy) if self.sharded else None  # a collective: every rank
        if self.trainer.is_global_zero and log_dir:
            out = Path(log_dir) if self.peft_model is not None else Path(log_dir) / "hf"
            # beside the weights: a VLM's processor (it holds the tokenizer), else the tokenizer
            processor = self.vision.images.processor if self.vision is not None else self.experience.tokenizer
            export = PolicyExport(self.policy, processor, self.settings.model_path, self.settings.policy,
                                  self.peft_model)
            export.write(out, state_dict=state_dict)
