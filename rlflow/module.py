"""``GRPOModule``: the policy (and, with a KL term, a frozen reference) and one GRPO step, top to bottom.

One ``training_step`` is one rollout step: ask the datamodule for fresh experience sampled from the current
weights, compute old and reference log-probs where they are needed, then take ``optimizer_steps`` optimizer
steps over shuffled mini-batches, each accumulated over micro-batches (manual optimization). Metrics use
TRL's names so dashboards compare.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from rlflow import registry
from rlflow.data.experience import Experience, collate
from rlflow.logprobs import completion_logprobs
from rlflow.losses.base import LossContext, masked_mean

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class NonFiniteLossError(RuntimeError):
    """Too many optimizer steps in a row had a NaN or infinite loss or gradient."""


def load_causal_lm(path: str, dtype: str = "float32", attn_implementation: str | None = None) -> torch.nn.Module:
    """``AutoModelForCausalLM.from_pretrained`` with a clear message for a path that does not exist."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"model.dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    local = Path(path).expanduser()
    if not local.exists() and (path.startswith((".", "/", "~")) or path.count("/") != 1):
        raise FileNotFoundError(
            f"model.model_path {path!r} does not exist; build the demo model with "
            "'python tools/make_tiny_model.py --out checkpoints/tiny-qwen3' or point it at a Hugging Face model directory"
        )
    kwargs: dict[str, Any] = {"dtype": DTYPES[dtype]}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_pretrained(str(local) if local.exists() else path, **kwargs)


class GRPOModule(L.LightningModule):
    """Owns the policy and reference models and runs the GRPO update."""

    def __init__(
        self,
        model_path: str,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 0,
        lr_schedule: str = "constant",
        max_grad_norm: float | None = 1.0,
        loss: Any = "bnpo",
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        kl_coef: float = 0.0,
        kl_type: str = "k3",
        ref_model_path: str | None = None,
        optimizer_steps: int = 1,
        micro_batch_size: int = 32,
        temperature: float = 1.0,
        max_tokens: int = 256,
        dtype: str = "float32",
        attn_implementation: str | None = None,
        gradient_checkpointing: bool = False,
        logprob_chunk_size: int = 1024,
        max_consecutive_skipped_steps: int = 3,
        export_hf: bool = True,
    ) -> None:
        """
        Args:
            model_path: Policy to train: a local Hugging Face model directory (or a hub id where the hub is reachable).
            lr: Peak learning rate of AdamW.
            weight_decay: AdamW weight decay.
            betas: AdamW betas.
            warmup_steps: Optimizer steps of linear warm-up from 0 to ``lr``.
            lr_schedule: After warm-up: ``constant``, ``linear`` (to 0 at the last step) or ``cosine``.
            max_grad_norm: Gradient clipping by global norm; None disables it.
            loss: Policy loss: a short name of the ``rlflow.losses`` group or ``class_path``/``init_args``.
            epsilon_low: Lower clip range of the importance ratio (``1 - epsilon_low``).
            epsilon_high: Upper clip range of the importance ratio (``1 + epsilon_high``; DAPO's clip-higher uses 0.28).
            kl_coef: Weight of the KL penalty to the reference model; 0 loads no reference model.
            kl_type: KL estimator: ``k1``, ``k2``, ``k3`` (``low_var_kl``) or ``abs``.
            ref_model_path: Reference model; defaults to ``model_path``.
            optimizer_steps: Optimizer steps (mini-batches) per rollout step.
            micro_batch_size: Sequences per forward/backward pass; gradients accumulate over a mini-batch.
            temperature: Temperature the log-probs are computed at; linked to ``data.temperature``.
            max_tokens: Most completion tokens; linked to ``data.max_tokens`` (used by normalisers such as Dr. GRPO's).
            dtype: Parameter dtype: ``float32``, ``bfloat16`` or ``float16``.
            attn_implementation: transformers attention implementation (``sdpa``, ``eager``, ``flash_attention_2``...).
            gradient_checkpointing: Recompute activations in the backward pass to save memory.
            logprob_chunk_size: Positions per chunk when turning hidden states into log-probs (bounds the logits memory).
            max_consecutive_skipped_steps: Stop the run after this many optimizer steps in a row with a NaN/inf loss or gradient.
            export_hf: At the end of ``fit``, write the policy and tokenizer with ``save_pretrained`` to ``<log_dir>/hf``.
        """
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        if optimizer_steps < 1 or micro_batch_size < 1:
            raise ValueError("model.optimizer_steps and model.micro_batch_size must be >= 1")
        if lr_schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"model.lr_schedule must be constant, linear or cosine, got {lr_schedule!r}")
        self.loss_fn = registry.build(
            "rlflow.losses", loss, epsilon_low=epsilon_low, epsilon_high=epsilon_high, kl_coef=kl_coef,
            kl_type=kl_type, max_tokens=max_tokens,
        )
        self.policy: torch.nn.Module | None = None
        self.policy_version = 0  # optimizer steps taken: the version of the weights that sample next
        self.num_tokens = 0.0  # TRL's cumulative prompt + completion tokens
        self.skipped_steps = 0
        self.consecutive_skips = 0
        self.trained_versions: list[tuple[int, int]] = []  # (policy_version at the update, versions sampled)

    # --------------------------------------------------------------------------------------------- models
    @property
    def ref_model(self) -> torch.nn.Module | None:
        """The frozen reference, kept out of ``state_dict`` (it never changes, so checkpoints need not hold it)."""
        return self.__dict__.get("_ref_model")

    def configure_model(self) -> None:
        if self.policy is not None:
            return
        hp = self.hparams
        self.policy = load_causal_lm(hp.model_path, hp.dtype, hp.attn_implementation)
        self.policy.train()
        if hp.gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
            self.policy.config.use_cache = False
        if hp.kl_coef > 0.0:
            ref = load_causal_lm(hp.ref_model_path or hp.model_path, hp.dtype, hp.attn_implementation)
            ref.eval().requires_grad_(False)
            self.__dict__["_ref_model"] = ref

    def on_fit_start(self) -> None:
        if self.ref_model is not None:
            self.ref_model.to(self.device)
        self.trainer.datamodule.bind(self.policy)

    def on_validation_start(self) -> None:
        self.trainer.datamodule.bind(self.policy)

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=hp.lr, betas=tuple(hp.betas), weight_decay=hp.weight_decay)
        total = max(int(self.trainer.estimated_stepping_batches), 1) if self.trainer is not None else 1
        warmup = hp.warmup_steps

        def factor(step: int) -> float:
            if warmup and step < warmup:
                return (step + 1) / warmup
            if hp.lr_schedule == "constant":
                return 1.0
            progress = min((step - warmup) / max(total - warmup, 1), 1.0)
            return 1.0 - progress if hp.lr_schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------------------------------ log-probs
    def logprobs_of(self, model: torch.nn.Module, experiences: list[Experience]) -> tuple[torch.Tensor, torch.Tensor, dict]:
        batch = {k: v.to(self.device) for k, v in collate(experiences, self.pad_id).items()}
        logprobs, entropy = completion_logprobs(model, batch, self.hparams.temperature, self.hparams.logprob_chunk_size)
        return logprobs, entropy, batch

    @torch.no_grad()
    def fill_logprobs(self, experiences: list[Experience], attr: str, model: torch.nn.Module) -> None:
        """Store ``model``'s log-probs of each completion in ``experience.<attr>`` (old or reference log-probs)."""
        was_training = model.training
        model.eval()
        try:
            mb = self.hparams.micro_batch_size
            for start in range(0, len(experiences), mb):
                chunk = experiences[start: start + mb]
                logprobs, _, batch = self.logprobs_of(model, chunk)
                for e, row in zip(chunk, logprobs.float().cpu()):
                    setattr(e, attr, row[: len(e.completion_ids)].tolist())
        finally:
            model.train(was_training)

    @property
    def pad_id(self) -> int:
        tok = self.trainer.datamodule.load_tokenizer()
        return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    # ----------------------------------------------------------------------------------------- training
    def training_step(self, batch: list, batch_idx: int) -> None:
        start = time.perf_counter()
        hp = self.hparams
        dm = self.trainer.datamodule
        metrics = dm.make_experience(batch, policy_version=self.policy_version, step=self.global_step)
        minibatches = dm.buffer.drain(hp.optimizer_steps)
        everything = [e for mb in minibatches for e in mb]
        if hp.optimizer_steps > 1:  # later mini-batches are off-policy: fix the ratio's denominator now
            self.fill_logprobs(everything, "old_logprobs", self.policy)
        if self.ref_model is not None:
            self.fill_logprobs(everything, "ref_logprobs", self.ref_model)
        generation_tokens = sum(len(e.completion_ids) for e in everything)
        sums: dict[str, float] = {}
        for minibatch in minibatches:
            sums = self.optimizer_step_on(minibatch, generation_tokens, len(everything), sums)
        n = len(minibatches)
        metrics.update({key: value / n for key, value in sums.items()})
        self.num_tokens += metrics.pop("num_prompt_tokens") + metrics.pop("num_completion_tokens")
        metrics["num_tokens"] = self.num_tokens
        metrics["train/skipped_steps"] = float(self.skipped_steps)
        metrics["lr"] = self.optimizers().param_groups[0]["lr"]
        metrics["step_time"] = time.perf_counter() - start
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(everything))
        self.last_metrics = metrics

    def optimizer_step_on(self, minibatch: list[Experience], generation_tokens: int, generation_seqs: int, sums: dict) -> dict:
        """One optimizer step over ``minibatch``, accumulated over micro-batches; adds its metrics to ``sums``."""
        hp = self.hparams
        opt = self.optimizers()
        sched = self.lr_schedulers()
        self.trained_versions.append((self.policy_version, max(e.policy_version for e in minibatch)))
        ctx = LossContext(
            mini_batch_sequences=len(minibatch),
            mini_batch_tokens=sum(len(e.completion_ids) for e in minibatch),
            generation_batch_sequences=generation_seqs,
            generation_batch_tokens=generation_tokens,
            max_tokens=hp.max_tokens,
            world_size=self.trainer.world_size,
        )
        opt.zero_grad(set_to_none=True)
        step: dict[str, float] = {}
        finite = True
        for start in range(0, len(minibatch), hp.micro_batch_size):
            micro = minibatch[start: start + hp.micro_batch_size]
            logprobs, entropy, batch = self.logprobs_of(self.policy, micro)
            mask = batch["completion_mask"]
            old = batch["old_logprobs"] if micro[0].old_logprobs is not None else logprobs.detach()
            ref = batch["ref_logprobs"] if micro[0].ref_logprobs is not None else None
            loss, loss_metrics = self.loss_fn(
                logprobs, old, batch["advantages"], mask, ref_logprobs=ref,
                rollout_logprobs=batch["rollout_logprobs"], entropy=entropy, ctx=ctx,
            )
            weight = self.loss_fn.micro_batch_weight(mask, ctx)
            if not torch.isfinite(loss):
                finite = False
                break
            self.manual_backward(loss * weight)
            loss_metrics["loss"] = loss.item()
            loss_metrics["entropy"] = masked_mean(entropy.detach(), mask).item()
            for key, value in loss_metrics.items():
                step[key] = step.get(key, 0.0) + weight * float(value)
        grad_norm = torch.tensor(0.0)
        if finite:
            grad_norm = self.clip_gradients_and_norm(hp.max_grad_norm)
            finite = bool(torch.isfinite(grad_norm))
        if not finite:
            self.skip_step(opt)
            return sums
        self.consecutive_skips = 0
        opt.step()
        sched.step()
        self.policy_version += 1
        self.trainer.datamodule.backend.sync_weights()
        step["grad_norm"] = float(grad_norm)
        for key, value in step.items():
            sums[key] = sums.get(key, 0.0) + value
        return sums

    def clip_gradients_and_norm(self, max_norm: float | None) -> torch.Tensor:
        params = [p for p in self.policy.parameters() if p.grad is not None]
        if not params:
            return torch.tensor(0.0)
        if max_norm is None:
            return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def skip_step(self, opt: Any) -> None:
        """Drop this optimizer step's gradients; stop the run after too many non-finite steps in a row."""
        opt.zero_grad(set_to_none=True)
        self.skipped_steps += 1
        self.consecutive_skips += 1
        print(f"[rlflow] step {self.global_step}: non-finite loss or gradient, optimizer step skipped "
              f"({self.consecutive_skips} in a row, {self.skipped_steps} in all)")
        if self.consecutive_skips >= self.hparams.max_consecutive_skipped_steps:
            raise NonFiniteLossError(
                f"{self.consecutive_skips} optimizer steps in a row had a NaN or infinite loss or gradient "
                f"(model.max_consecutive_skipped_steps={self.hparams.max_consecutive_skipped_steps}); lower model.lr, "
                "set model.max_grad_norm, or use model.dtype=float32. Checkpoints written so far are intact."
            )

    # ---------------------------------------------------------------------------------------- evaluation
    def validation_step(self, batch: list, batch_idx: int) -> None:
        out = self.trainer.datamodule.evaluate_batch(batch)
        n = len(out["rewards"])
        self.log("eval/reward", sum(out["rewards"]) / n, batch_size=n, on_epoch=True)
        self.log("eval/accuracy", sum(out["correct"]) / n, batch_size=n, on_epoch=True, prog_bar=True)
        self.log("eval/mean_length", sum(out["lengths"]) / n, batch_size=n, on_epoch=True)

    # --------------------------------------------------------------------------------------- checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["rlflow"] = {
            "policy_version": self.policy_version, "num_tokens": self.num_tokens, "skipped_steps": self.skipped_steps,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("rlflow", {})
        self.policy_version = state.get("policy_version", 0)
        self.num_tokens = state.get("num_tokens", 0.0)
        self.skipped_steps = state.get("skipped_steps", 0)

    def on_fit_end(self) -> None:
        if self.hparams.export_hf and self.trainer.is_global_zero and self.trainer.log_dir:
            self.export_hf(Path(self.trainer.log_dir) / "hf")

    def export_hf(self, out_dir: Path) -> Path:
        """Write the policy and tokenizer with ``save_pretrained``; ``AutoModelForCausalLM`` reloads it."""
        out_dir.mkdir(parents=True, exist_ok=True)
        self.policy.save_pretrained(out_dir)
        self.trainer.datamodule.load_tokenizer().save_pretrained(out_dir)
        print(f"[rlflow] exported the policy to {out_dir}")
        return out_dir
