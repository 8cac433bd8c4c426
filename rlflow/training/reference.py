"""Moving the KL reference toward the policy during training (``model.reference.sync_steps``).

A KL penalty to a frozen reference keeps the policy near its starting point; over a long run that anchor also
holds it back. TR-DPO and TRL's ``sync_ref_model`` move the reference every ``N`` steps by a soft update,
``ref <- alpha * policy + (1 - alpha) * ref`` (TRL's ``ref_model_mixup_alpha``, 0.6 by default); with ``alpha = 1``
the reference is reset to the current policy, as NVIDIA's ProRL does every few hundred steps.

The reference then no longer equals the weights it was loaded from, so it is checkpointed with the policy
(:class:`~rlflow.training.module.GRPOModule` registers it as a submodule when syncing is on) and a resumed run continues
with the reference it had.

Simplifications: ``N`` counts rollout steps (rlflow's step unit; TRL counts optimizer steps, the same with one
optimizer step per rollout step); the update is per parameter in the parameters' own dtype (under FSDP2 on each
rank's shards, policy and reference being sharded alike); switching syncing on or off when continuing a checkpoint
is handled for single-file checkpoints (on: the reference starts from the loaded weights; off: the checkpoint's
moved reference is kept), not for FSDP2's sharded ones, whose loader reads exactly the module's own keys (on: an
error for the missing reference; off: the reference is the loaded weights again); LoRA runs are refused (their
reference is the base model under the adapters, which syncing would have to change, and a separate reference would
need the adapters merged).
"""

from __future__ import annotations

import torch

from rlflow.config_error import ConfigError


def check_same_layout(policy: torch.nn.Module, ref: torch.nn.Module) -> None:
    """ConfigError unless ``ref`` has the policy's parameters (names and shapes), so one can be mixed into the
    other (a ``model.reference.path`` of another architecture cannot)."""
    mine = {n: tuple(p.shape) for n, p in policy.named_parameters()}
    theirs = {n: tuple(p.shape) for n, p in ref.named_parameters()}
    if mine != theirs:
        diff = sorted(set(mine.items()) ^ set(theirs.items()))[:3]
        raise ConfigError(
            f"model.reference.sync_steps: the reference (model.reference.path) and the policy have "
            f"different parameters, so the policy cannot be mixed into it; first differences: {diff}"
        )


@torch.no_grad()
def sync_reference(ref: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """``ref <- alpha * policy + (1 - alpha) * ref``, parameter by parameter (TRL's ``SyncRefModelCallback``
    formula); ``alpha = 1`` copies the policy exactly."""
    for (name, r), (other, p) in zip(ref.named_parameters(), policy.named_parameters()):
        if name != other:
            raise RuntimeError(f"reference parameter {name!r} meets policy parameter {other!r}")
        if alpha == 1.0:
            r.copy_(p)
        else:
            r.mul_(1.0 - alpha).add_(p.to(r.dtype), alpha=alpha)
