"""What a checkpoint holds besides the weights, so that ``--ckpt_path`` continues a run where it stopped.

:class:`ResumeState` is the part of :class:`~rlflow.training.module.GRPOModule` that writes and reads the
checkpoint's ``rlflow`` entry: the counters (policy version, tokens, skipped optimizer steps), the loss's own
training state, the length of the learning-rate schedule and every rank's RNG state
(:mod:`rlflow.training.checkpointing`). The RNG states and the schedule are applied in ``on_train_start``, once
Lightning has finished its own set-up (seeding, restoring the scheduler): sampling after a resume draws what it
would have drawn, and a run continued with another ``trainer.max_steps`` lets a decaying schedule end where the
new run ends (:meth:`ResumeState.respan_lr_schedule`).

:func:`checkpoint_state` and :func:`loadable_state` are what the module's ``state_dict``/``load_state_dict``
add: under ``model.lora`` a checkpoint leaves out the frozen base weights; a moved KL reference
(``model.reference.sync_steps``) is checkpointed, and a resumed run that switched syncing on or off adapts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlflow.log import info
from rlflow.training.checkpointing import gather_rng_states, restore_rng_state
from rlflow.training.optim import rebuild_lr_scheduler

#: The module's counters a checkpoint holds, with their values before the first step.
COUNTERS = {"policy_version": 0, "num_tokens": 0.0, "skipped_steps": 0, "consecutive_skips": 0}


class ResumeState:
    """The checkpoint's ``rlflow`` entry of one module (see the module docstring)."""

    def __init__(self) -> None:
        self.rng: list[dict[str, Any]] | None = None  # loaded, applied in on_train_start
        self.lr_steps: int | None = None  # the checkpoint's schedule length, compared in on_train_start

    def save(self, module: Any, checkpoint: dict[str, Any]) -> None:
        """``on_save_checkpoint``: the counters, the schedule length, every rank's RNG, the loss's state."""
        trainer = module._trainer
        checkpoint["rlflow"] = {
            **{name: getattr(module, name) for name in COUNTERS},
            "lr_schedule_steps": getattr(module, "lr_schedule_steps", None),
            # every rank's Python/NumPy/torch RNG, so sampling after a resume draws what it would have drawn
            "rng": gather_rng_states(trainer.world_size if trainer is not None else 1),
            "loss": module.loss_fn.state_dict(),  # a loss's own training state (adaptive entropy control)
        }

    def load(self, module: Any, checkpoint: dict[str, Any]) -> None:
        """``on_load_checkpoint``: the counters and the loss's state now, the RNG and schedule at train start."""
        state = checkpoint.get("rlflow", {})
        for name, default in COUNTERS.items():
            setattr(module, name, state.get(name, default))
        module.loss_fn.load_state_dict(state.get("loss", {}))
        self.rng = state.get("rng")
        self.lr_steps = state.get("lr_schedule_steps")
        trainer, step = module._trainer, checkpoint.get("global_step", 0)
        if trainer is not None and trainer.state.fn == "fit" and 0 <= (trainer.max_steps or -1) <= step:
            info(f"the checkpoint is at rollout step {step} and trainer.max_steps={trainer.max_steps}: the run is "
                 "already finished, nothing is trained (raise --trainer.max_steps to continue it)")

    def on_train_start(self, module: Any) -> None:
        """Restore this rank's RNG state (when the checkpoint has one per rank of this run), then re-span the
        learning-rate schedule."""
        states, self.rng = self.rng, None
        trainer = module.trainer
        if states and trainer.state.fn == "fit":
            if len(states) == trainer.world_size:
                restore_rng_state(states[trainer.global_rank])
            else:
                info(f"the checkpoint holds RNG states of {len(states)} rank(s), this run has "
                     f"{trainer.world_size}: sampling continues from a fresh seed, not bit-exactly")
        self.respan_lr_schedule(module)

    def respan_lr_schedule(self, module: Any) -> None:
        """After a resume with another ``max_steps`` (or ``max_epochs``), let a decaying schedule end where this
        run ends: the schedule of a run of the new length, at the optimizer step reached (Lightning restored the
        checkpoint's scheduler, which ended at the old length)."""
        saved, self.lr_steps = self.lr_steps, None
        optim, configs = module.settings.optim, module.trainer.lr_scheduler_configs
        total = module.lr_schedule_steps
        if saved is None or saved == total or optim.lr_schedule == "constant" or not configs:
            return
        taken = configs[0].scheduler.last_epoch
        configs[0].scheduler = rebuild_lr_scheduler(
            configs[0].scheduler.optimizer, optim.lr_schedule, optim.warmup_steps, total, taken)
        lr = float(module.optimizers().param_groups[0]["lr"])
        info(f"model.optim.lr_schedule={optim.lr_schedule} spans {total} optimizer steps now (the checkpoint's run: "
             f"{saved}); continuing at step {taken}, lr {lr:.3g}")


# --------------------------------------------------------------------------------------------- weights
def checkpoint_state(module: Any, state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The module's ``state_dict`` as checkpoints hold it: under ``model.lora`` without the frozen base weights
    (they are ``model.model_path``'s), so checkpoints hold the adapters, and the optimizer state only theirs."""
    if module.peft_model is None:
        return state
    from rlflow.models.lora import frozen_keys, trainable_state

    return trainable_state(state, frozen_keys(module.policy, prefix + "policy."))


def loadable_state(module: Any, state_dict: Any, live: Callable[[], dict[str, Any]]) -> Any:
    """A checkpoint's ``state_dict`` as the module loads it (``live``: the module's own full state dict): under
    ``model.lora`` the missing base weights are the live (never trained) ones; the ``reference.*`` entries as
    :func:`reference_entries` says."""
    state_dict = reference_entries(module, state_dict)
    if module.peft_model is None:
        return state_dict
    from rlflow.models.lora import complete_state, frozen_keys

    return complete_state(state_dict, live(), frozen_keys(module.policy, "policy."))


def reference_entries(module: Any, state_dict: Any) -> Any:
    """``state_dict`` with the ``reference.*`` entries this module has. A checkpoint without the reference
    (``model.reference.sync_steps`` was 0) continues with the reference as loaded; one with a moved reference
    continues with that one, synced or not (the module then checkpoints it too); a run without a KL term drops
    it."""
    saved = any(k.startswith("reference.") for k in state_dict)
    if saved and "reference" not in module._modules and module.outside.reference is not None:
        info("the checkpoint holds a KL reference moved by model.reference.sync_steps: this run continues "
             "with it, and with model.reference.sync_steps=0 it stays there")
        module.adopt_reference()
    if saved == ("reference" in module._modules):
        return state_dict
    if not saved:
        info("the checkpoint holds no KL reference (saved with model.reference.sync_steps=0): the reference "
             "starts from model.reference.path / model.model_path and moves from here")
        return {**state_dict, **module.reference.state_dict(prefix="reference.")}
    return {k: v for k, v in state_dict.items() if not k.startswith("reference.")}  # no KL term now
