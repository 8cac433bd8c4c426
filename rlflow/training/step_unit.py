"""One step unit for the whole run: the rollout step.

One ``training_step`` of :class:`rlflow.training.module.GRPOModule` is one rollout step: generation, then
``model.update.optimizer_steps * model.update.num_iterations`` optimizer steps. Under manual optimization Lightning's
``trainer.global_step`` counts ``LightningOptimizer.step`` calls (the manual loop hooks ``_on_before_step`` /
``_on_after_step`` of the optimizer, which advance its ``optim_step_progress``), while the data loader,
``val_check_interval``, ``log_every_n_steps`` and the loggers' ``step`` count training batches, i.e. rollout
steps. Two units made ``samples.every_n_steps: 10`` never fire with 4 optimizer steps per rollout and
``val_check_interval: 40`` mean 40 rollout steps, not 10.

rlflow makes ``global_step`` count rollout steps: the *last* optimizer step of a rollout step goes through
``LightningOptimizer.step`` (Lightning counts it), the earlier ones through ``trainer.strategy.optimizer_step``,
which is the same precision-plugin and strategy path (``bf16-mixed``, FSDP2, the ``on_before_optimizer_step``
hook) without the count. A rollout step whose counted optimizer step was skipped (non-finite loss) is still
counted, by :func:`count_rollout_step`. So every user-facing step count is in rollout steps: ``trainer.max_steps``,
``checkpoint.every_n_train_steps``, ``val_check_interval`` / ``--evaluate_every_n_steps``,
``samples.every_n_steps``, ``log_every_n_steps``, the metrics' ``step`` column, ``trajectories.jsonl``'s ``step``
and the summary line. ``policy_version`` still counts optimizer steps (it stamps experiences) and the learning
rate schedule is stepped once per optimizer step.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer, do_nothing_closure


def optimizer_step(trainer: Any, optimizer: LightningOptimizer, count: bool) -> None:
    """Step ``optimizer``; only with ``count`` does Lightning's ``global_step`` advance (by one)."""
    if count:
        optimizer.step()
        return
    with trainer.profiler.profile("optimizer_step"):
        trainer.strategy.optimizer_step(optimizer.optimizer, closure=do_nothing_closure)


def count_rollout_step(optimizer: LightningOptimizer) -> None:
    """Advance ``global_step`` by one without an optimizer step (the rollout step's counted step was skipped).

    These are the two progress hooks ``LightningOptimizer.step`` runs around the strategy's step: the manual
    optimization loop installs them to count ``optim_step_progress`` (ready, then completed).
    """
    optimizer._on_before_step()
    optimizer._on_after_step()
