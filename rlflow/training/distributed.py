"""FSDP2 for rlflow through Lightning's ``ModelParallelStrategy``, and the collectives the GRPO step needs.

:class:`FSDP2Strategy` is Lightning's ``ModelParallelStrategy`` preset for data parallelism only: one
``data_parallel`` mesh dimension over every rank (tensor parallel size 1), FSDP2's mixed precision and CPU
offload as plain options. ``GRPOModule.configure_model`` calls :func:`shard_model`, which applies
``fully_shard`` to every decoder layer and then to the root, for the policy and the frozen reference alike. It
is registered in Lightning's ``StrategyRegistry`` as ``fsdp2`` (plus ``fsdp2_bf16`` and ``fsdp2_cpu_offload``),
and rlflow's CLI maps ``trainer.strategy: fsdp`` to ``fsdp2``, since rlflow shards in ``configure_model`` the
FSDP2 way and Lightning's own ``fsdp`` (FSDP1) would wrap the whole module instead. It runs on CPU with gloo as
well as on CUDA with NCCL. Its distributed checkpoints (a folder of shards per checkpoint) are written atomically,
to a temporary folder renamed into place.

The rest is small helpers: :func:`full_weights` unshards a sharded model for generation (every decode step
would otherwise all-gather, and ranks that stop at different lengths would deadlock) and reshards it after;
:func:`gather_full_state_dict` assembles full weights on rank 0 for the Hugging Face export; :func:`all_gather`,
:func:`all_sum` and :func:`reduce_metrics` turn per-rank values into global ones.

Simplifications: no tensor or pipeline parallelism (a ``ModelParallelStrategy`` with ``tensor_parallel_size``
above 1 is refused); every rank loads the full checkpoint on CPU before sharding it (host memory: ranks x model);
the metric reduction assumes every rank holds the same number of samples, which rlflow's ``rank_share`` ensures.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry

from rlflow.training.fsdp_units import fsdp_modules, full_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: rlflow's names for strategies: ``trainer.strategy: fsdp`` means FSDP2 applied by ``configure_model``.
STRATEGY_ALIASES = {"fsdp": "fsdp2"}


def _dtype(name: str | None, arg: str) -> torch.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise ValueError(f"{arg} must be one of {', '.join(DTYPES)} or null, got {name!r}")
    return DTYPES[name]


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` set up for FSDP2 data parallelism over all ranks, with FSDP2's options.

    Exists because the parent class defaults to tensor parallelism within a node and knows nothing of how to
    shard a Hugging Face model; this preset makes the mesh one ``data_parallel`` dimension and carries the
    sharding options that :func:`shard_model` applies in ``GRPOModule.configure_model``.
    """

    def __init__(
        self,
        param_dtype: str | None = None,
        reduce_dtype: str | None = None,
        cpu_offload: bool = False,
        reshard_after_forward: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        """
        Args:
            param_dtype: FSDP2 mixed precision: dtype of the unsharded parameters in forward/backward (``bfloat16``,
                ``float16``, ``float32``); null computes in the parameters' own dtype.
            reduce_dtype: FSDP2 mixed precision: dtype of the gradient reduce-scatter; null uses ``param_dtype``.
            cpu_offload: Keep sharded parameters, gradients and optimizer state in host memory (FSDP2's
                ``CPUOffloadPolicy``); the optimizer step then runs on CPU. Needs CUDA devices.
            reshard_after_forward: Free the unsharded decoder layers after forward (ZeRO-3); false keeps them
                until after backward (ZeRO-2: faster, more memory).
            save_distributed_checkpoint: Each rank writes its shard (a checkpoint folder); false gathers a single
                file on rank 0.
            process_group_backend: ``nccl`` / ``gloo``; default: nccl on CUDA, gloo on CPU.
            timeout: Timeout of collectives.
        """
        super().__init__(
            data_parallel_size="auto", tensor_parallel_size=1, save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend, timeout=timeout,
        )
        self.param_dtype = _dtype(param_dtype, "param_dtype")
        self.reduce_dtype = _dtype(reduce_dtype, "reduce_dtype")
        self.cpu_offload = cpu_offload
        self.reshard_after_forward = reshard_after_forward

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":  # every rank in one data-parallel (sharding) group
            self._data_parallel_size = self.num_nodes * self.num_processes
        if self.cpu_offload and self.root_device.type != "cuda":
            raise ValueError("FSDP2Strategy(cpu_offload=true) offloads from CUDA devices; use trainer.accelerator=gpu")
        super().setup_environment()

    def mp_policy(self) -> Any:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)

    def offload_policy(self) -> Any:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        return CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """A distributed checkpoint (a folder of shards) is written to a temporary sibling folder and then renamed
        into place (:func:`rlflow.training.checkpointing.save_folder_atomically`): a kill during the save leaves the
        previous checkpoint folder whole. A single-file checkpoint goes through the checkpoint IO (atomic too)."""
        from rlflow.training.checkpointing import is_local, save_folder_atomically

        if storage_options is not None or not self._save_distributed_checkpoint or not is_local(filepath):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        write = super().save_checkpoint
        save_folder_atomically(self, filepath, lambda folder: write(checkpoint, folder))

    def model_to_device(self) -> None:
        if not self.cpu_offload:
            return super().model_to_device()
        # Offloaded shards must stay in host memory; only buffers (rotary tables...) go to the device.
        for module in self.model.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                module._buffers[name] = buf.to(self.root_device)


def register_strategies() -> None:
    """Register ``fsdp2``, ``fsdp2_bf16`` and ``fsdp2_cpu_offload`` in Lightning's ``StrategyRegistry`` (idempotent)."""
    presets = {
        "fsdp2": ("FSDP2 over all ranks, float32", {}),
        "fsdp2_bf16": ("FSDP2 over all ranks, bfloat16 compute, float32 gradient reduction",
                       {"param_dtype": "bfloat16", "reduce_dtype": "float32"}),
        "fsdp2_cpu_offload": ("FSDP2 over all ranks, parameters and optimizer state offloaded to CPU",
                              {"cpu_offload": True}),
    }
    for name, (description, params) in presets.items():
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, FSDP2Strategy, description=description, **params)


def resolve_strategy_alias(value: Any) -> Any:
    """``fsdp`` -> ``fsdp2``; anything else is returned unchanged."""
    return STRATEGY_ALIASES.get(value, value) if isinstance(value, str) else value


register_strategies()


# ------------------------------------------------------------------------------------------------- sharding
def is_sharded(strategy: Any) -> bool:
    """Whether ``strategy`` is one under which ``configure_model`` shards the models with FSDP2."""
    return isinstance(strategy, ModelParallelStrategy)


def data_parallel_mesh(strategy: ModelParallelStrategy) -> Any:
    """The 1-D mesh to shard over; refuses tensor parallelism, which rlflow does not apply."""
    mesh = strategy.device_mesh
    tp = mesh["tensor_parallel"].size()
    if tp != 1:
        raise ValueError(
            f"the ModelParallelStrategy has tensor_parallel_size={tp}, but rlflow applies FSDP2 data parallelism only; "
            "use trainer.strategy=fsdp (rlflow.training.distributed.FSDP2Strategy) or "
            "ModelParallelStrategy(data_parallel_size=<world size>, tensor_parallel_size=1)"
        )
    return mesh["data_parallel"]


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face model: modules whose class is in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"cannot find the decoder layers of {type(model).__name__} to shard: its _no_split_modules is "
            f"{sorted(names) or 'empty'}; FSDP2 needs per-layer units"
        )
    return layers


def shard_model(
    model: torch.nn.Module,
    mesh: Any,
    mp_policy: Any = None,
    offload_policy: Any = None,
    reshard_after_forward: bool = True,
) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root (embeddings, final norm, LM head) of ``model``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = dict(
        mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy(), offload_policy=offload_policy or OffloadPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
    fully_shard(model, **kwargs)
    model.__dict__["_rlflow_reshard_after_forward"] = reshard_after_forward
    return model


def sharded_completion_logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float = 1.0, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rlflow.training.logprobs.completion_logprobs` for an FSDP2-sharded model.

    The decoder runs through the root's forward (:func:`root_hidden_states`); the LM head is then applied chunk
    by chunk to the unsharded head weight, which the root keeps until its backward (FSDP2 does not reshard the
    root after forward).
    """
    from rlflow.training.logprobs import model_inputs, naive_token_stats, token_stats_from_hidden

    targets = batch["completion_ids"]
    width = targets.shape[1]
    inputs = model_inputs(batch)
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    config = getattr(model, "config", None)
    postprocessed = any(getattr(config, n, None) for n in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
    if base is None or model.get_output_embeddings() is None or postprocessed:
        logits = model(**inputs, logits_to_keep=width + 1).logits[:, :-1]
        return naive_token_stats(logits, targets, temperature)
    hidden = root_hidden_states(model, inputs)[:, -width - 1: -1]
    stats = token_stats_from_hidden(hidden, targets, model.get_output_embeddings(), temperature, chunk_size)
    reshard_root_without_grad(model)
    return stats


def root_hidden_states(model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """The base model's last hidden state, from a forward of the whole (FSDP2 root) ``model``.

    The root's parameters (embeddings, final norm, LM head) are unsharded only by the root's own forward, so
    the decoder is run through ``model(**inputs)`` (keeping one position of logits) with a hook catching the
    base model's output; the LM head's unsharded weight then stays until the root's backward.
    """
    base = getattr(model, getattr(model, "base_model_prefix", ""))
    caught: dict[str, torch.Tensor] = {}
    hook = base.register_forward_hook(lambda _m, _a, out: caught.__setitem__("hidden", out.last_hidden_state))
    try:
        model(**inputs, use_cache=False, logits_to_keep=1)
    finally:
        hook.remove()
    return caught["hidden"]


def reshard_root_without_grad(model: torch.nn.Module) -> None:
    """Outside autograd no backward will free the root's unsharded weights (old/reference log-probs): free them."""
    if not torch.is_grad_enabled() and hasattr(model, "reshard"):
        model.reshard()


def gather_full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) weights on CPU on rank 0, ``{}`` elsewhere; a collective every rank must call."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective); a plain tensor as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


# ---------------------------------------------------------------------------------------------- collectives
def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """Concatenate an equally sized tensor from every rank, in rank order (the tensor itself on one process)."""
    if world_size() == 1:
        return t
    local = t.detach().to(_comm_device()).contiguous()
    parts = [torch.empty_like(local) for _ in range(world_size())]
    dist.all_gather(parts, local)
    return torch.cat(parts).to(t.device)


def all_sum(values: list[float]) -> list[float]:
    """Element-wise sum of a list of numbers over ranks (float64)."""
    if world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_max(value: int) -> int:
    """The largest ``value`` over ranks (the value itself on one process)."""
    if world_size() == 1:
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.long, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_true(flag: bool) -> bool:
    """True only if ``flag`` is true on every rank (so every rank takes the same branch)."""
    return all_sum([0.0 if flag else 1.0])[0] == 0.0


#: Metrics that add up over ranks (counts, and throughput of ranks working side by side).
SUM_METRICS = ("judger/unscored", "judger/failures", "rollout/tokens_per_s")
SUM_PREFIXES = ("num_", "sampling/groups_")
#: Metrics that take the slowest rank.
MAX_METRICS = ("rollout/time", "step_time", "sampling/rounds")


def combine_metrics(
    per_rank: list[dict[str, float]], samples_per_rank: int, sum_keys: set[str] = frozenset()
) -> dict[str, float]:
    """Global metrics from each rank's metrics over ``samples_per_rank`` samples (equal on every rank).

    Rules: ``sum_keys``, :data:`SUM_METRICS` and names starting with :data:`SUM_PREFIXES` add up; names with a
    ``min``/``max`` part take the min/max; :data:`MAX_METRICS` take the slowest rank;
    ``completions/mean_terminated_length`` is weighted by each rank's terminated count; ``rewards/<j>/std`` is
    pooled from the ranks' means and sample stds; everything else is a plain mean (exact for means over equal
    counts, such as ``reward``, ``reward_std`` (a mean over groups) and ``frac_reward_zero_std``).
    """
    n, r = samples_per_rank, len(per_rank)
    first = per_rank[0]
    out: dict[str, float] = {}
    for key in first:
        vals = [float(m[key]) for m in per_rank if key in m]
        parts = key.rsplit("/", 1)[-1].split("_")
        if key in sum_keys or key in SUM_METRICS or key.startswith(SUM_PREFIXES):
            out[key] = sum(vals)
        elif "min" in parts:
            out[key] = min(vals)
        elif "max" in parts or key in MAX_METRICS:
            out[key] = max(vals)
        elif key == "completions/mean_terminated_length" and "completions/clipped_ratio" in first:
            weights = [n * (1.0 - m["completions/clipped_ratio"]) for m in per_rank]
            out[key] = sum(w * v for w, v in zip(weights, vals)) / sum(weights) if sum(weights) else 0.0
        elif key.startswith("rewards/") and key.endswith("/std") and key[:-3] + "mean" in first and len(vals) == r:
            means = [m[key[:-3] + "mean"] for m in per_rank]
            grand = sum(means) / r
            ss = sum((n - 1) * s * s + n * (mu - grand) ** 2 for s, mu in zip(vals, means))
            out[key] = (ss / max(r * n - 1, 1)) ** 0.5
        else:
            out[key] = sum(vals) / len(vals)
    return out


def reduce_metrics(
    metrics: dict[str, float], samples_per_rank: int, sum_keys: set[str] = frozenset()
) -> dict[str, float]:
    """:func:`combine_metrics` over every rank's ``metrics`` (gathered as objects); unchanged on one process."""
    if world_size() == 1:
        return dict(metrics)
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, {k: float(v) for k, v in metrics.items()})
    return combine_metrics(gathered, samples_per_rank, set(sum_keys))


__all__ = [
    "FSDP2Strategy", "STRATEGY_ALIASES", "register_strategies", "resolve_strategy_alias", "is_sharded", "shard_model",
    "data_parallel_mesh", "decoder_layers", "fsdp_modules", "full_weights", "sharded_completion_logprobs",
    "root_hidden_states", "reshard_root_without_grad", "gather_full_state_dict", "all_max",
    "full_tensor", "all_gather", "all_sum", "all_true", "combine_metrics", "reduce_metrics", "world_size",
]
