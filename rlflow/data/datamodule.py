"""``RolloutDataModule``: prompts in, judged experience out.

The train dataloader yields *prompt batches* only, which are cheap, so Lightning's one-batch prefetch costs
nothing and cannot make training off-policy: the expensive part, :meth:`RolloutDataModule.make_experience`
(generate ``prompt_repeat_k`` completions per prompt, judge them, compute group advantages, fill the replay
buffer), is called by :class:`rlflow.module.GRPOModule` inside ``training_step``, after the previous optimizer
step, with the live policy. Every experience is stamped with the policy version that sampled it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from rlflow import registry
from rlflow.data.dataset import DataError, PromptRecord, read_jsonl
from rlflow.data.experience import Experience
from rlflow.data.replay_buffer import ReplayBuffer
from rlflow.data.sampler import PromptBatchSampler
from rlflow.judgers.runner import JudgerRunner
from rlflow.rollout.base import RolloutBackend, SamplingParams


def _as_list(paths: str | list[str] | None) -> list[str]:
    if paths is None:
        return []
    return [paths] if isinstance(paths, str) else list(paths)


def _keep_records(batch: list[PromptRecord]) -> list[PromptRecord]:
    return list(batch)


class RolloutDataModule(L.LightningDataModule):
    """Wraps the prompt datasets, the rollout backend, the judgers and the replay buffer."""

    def __init__(
        self,
        train_data_path: str | list[str],
        eval_data_path: str | list[str] | None = None,
        tokenizer_path: str | None = None,
        prompt_repeat_k: int = 8,
        global_batch_size: int = 16,
        max_prompt_length: int = 512,
        max_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: list[str] | None = None,
        judgers: dict[str, Any] | None = None,
        reward_weights: dict[str, float] | None = None,
        advantage: Any = "grpo",
        rollout: Any = "hf",
        system_prompt: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        eval_temperature: float = 0.0,
        eval_batch_size: int = 64,
        eval_pass_threshold: float = 1.0,
        seed: int = 0,
        log_trajectories: bool = True,
    ) -> None:
        """
        Args:
            train_data_path: Training prompts: a jsonl file in XTuner's RL format or TRL's layout (or a list of them).
            eval_data_path: Evaluation prompts in the same format; None disables evaluation.
            tokenizer_path: Tokenizer to load; linked to ``model.model_path`` by the CLI.
            prompt_repeat_k: Completions sampled per prompt (the GRPO group size, at least 2).
            global_batch_size: Prompts per rollout step, over all ranks.
            max_prompt_length: Prompts longer than this many tokens are dropped (and counted), never truncated.
            max_tokens: Most tokens generated per completion.
            temperature: Sampling temperature of training rollouts (also used for the training log-probs).
            top_p: Nucleus sampling threshold (1.0 disables it).
            top_k: Top-k sampling (0 disables it).
            stop: Extra stop strings, each a single token of the tokenizer; the tokenizer's EOS always stops.
            judgers: Judgers per ``data_source``: a short name, ``class_path``/``init_args``, or a list; ``*`` catches every source.
            reward_weights: Weight of each judger (by name) in the summed reward; default 1.0.
            advantage: Advantage estimator: a short name of the ``rlflow.advantages`` group or ``class_path``/``init_args``.
            rollout: Rollout backend: a short name of the ``rlflow.rollout`` group or ``class_path``/``init_args``.
            system_prompt: If set, replaces (or adds) the system message of every chat prompt.
            chat_template_kwargs: Extra keyword arguments for the chat template (e.g. ``enable_thinking: false``).
            eval_temperature: Temperature of evaluation rollouts; 0 is greedy.
            eval_batch_size: Prompts per evaluation batch.
            eval_pass_threshold: An evaluation completion counts as correct when its reward is at least this.
            seed: Seed of the prompt order (each epoch uses ``seed + epoch``).
            log_trajectories: Append every rollout step's samples to ``<log_dir>/trajectories.jsonl``.
        """
        super().__init__()
        if prompt_repeat_k < 2:
            raise ValueError(
                f"data.prompt_repeat_k={prompt_repeat_k}: GRPO compares the completions of one prompt with each other, "
                "so a group needs at least 2 (a group of 1 has no mean or std to compare against); use 2 or more"
            )
        self.train_paths = _as_list(train_data_path)
        if not self.train_paths:
            raise ValueError("data.train_data_path is empty")
        self.eval_paths = _as_list(eval_data_path)
        self.tokenizer_path = tokenizer_path
        self.prompt_repeat_k = prompt_repeat_k
        self.global_batch_size = global_batch_size
        self.max_prompt_length = max_prompt_length
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.stop = list(stop or [])
        self.judger_specs = judgers if judgers is not None else {"openai/gsm8k": "gsm8k"}
        self.reward_weights = reward_weights
        self.advantage_spec = advantage
        self.rollout_spec = rollout
        self.system_prompt = system_prompt
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.eval_temperature = eval_temperature
        self.eval_batch_size = eval_batch_size
        self.eval_pass_threshold = eval_pass_threshold
        self.seed = seed
        self.log_trajectories = log_trajectories
        self.buffer = ReplayBuffer(seed=seed)
        self.tokenizer: Any = None
        self.train_records: list[PromptRecord] = []
        self.eval_records: list[PromptRecord] = []
        self.dropped: dict[str, int] = {"train": 0, "eval": 0}
        self.sampler: PromptBatchSampler | None = None
        self.backend: RolloutBackend | None = None
        # Built here, not in setup, so that a wrong plugin name fails before any model is loaded.
        self.judger_runner = JudgerRunner(self.judger_specs, reward_weights)
        self.advantage = registry.build("rlflow.advantages", advantage)
        self._sampler_state: dict[str, Any] | None = None

    # ----------------------------------------------------------------------------------------------- set-up
    def load_tokenizer(self) -> Any:
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            if self.tokenizer_path is None:
                raise ValueError("data.tokenizer_path is not set (the CLI links it to model.model_path)")
            if not Path(self.tokenizer_path).exists() and self.tokenizer_path.startswith((".", "/", "~")):
                raise FileNotFoundError(f"tokenizer path {self.tokenizer_path!r} does not exist")
            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            if self.tokenizer.pad_token_id is None:
                self.tokenizer.pad_token = self.tokenizer.eos_token
        return self.tokenizer

    def sampling_params(self, eval: bool = False) -> SamplingParams:
        tok = self.load_tokenizer()
        stop_ids = [tok.eos_token_id] if tok.eos_token_id is not None else []
        for s in self.stop:
            ids = tok.encode(s, add_special_tokens=False)
            if len(ids) != 1:
                raise ValueError(f"data.stop entry {s!r} is {len(ids)} tokens for this tokenizer; stop strings must be one token")
            stop_ids.append(ids[0])
        if eval:
            return SamplingParams(self.eval_temperature, 1.0, 0, self.max_tokens, stop_ids)
        return SamplingParams(self.temperature, self.top_p, self.top_k, self.max_tokens, stop_ids)

    def render_prompt(self, record: PromptRecord) -> str:
        """The prompt text the model sees: the chat template applied to messages, or a plain string as is."""
        tok = self.load_tokenizer()
        if isinstance(record.prompt, str):
            return record.prompt
        messages = list(record.prompt)
        if self.system_prompt is not None:
            messages = [m for m in messages if m["role"] != "system"]
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        if not getattr(tok, "chat_template", None):
            raise DataError(
                f"{record.source}: field 'prompt' is a list of chat messages but the tokenizer at {self.tokenizer_path} "
                "has no chat template; use a chat/instruct tokenizer, set one, or give prompts as plain strings"
            )
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs)

    def prepare_records(self, paths: list[str], split: str) -> list[PromptRecord]:
        """Read, render and tokenize every prompt; drop (and count) those over ``max_prompt_length``."""
        tok = self.load_tokenizer()
        kept: list[PromptRecord] = []
        dropped = 0
        for path in paths:
            for record in read_jsonl(path):
                record.prompt_text = self.render_prompt(record)
                record.prompt_ids = tok(record.prompt_text, add_special_tokens=False)["input_ids"]
                if len(record.prompt_ids) > self.max_prompt_length:
                    dropped += 1
                    continue
                kept.append(record)
        self.dropped[split] = dropped
        if dropped:
            print(f"[rlflow] {split}: dropped {dropped} prompt(s) longer than data.max_prompt_length={self.max_prompt_length} tokens")
        if not kept:
            raise DataError(
                f"no usable {split} prompts in {', '.join(paths)}: all {dropped} are longer than "
                f"data.max_prompt_length={self.max_prompt_length}"
            )
        return kept

    def setup(self, stage: str) -> None:
        if stage == "fit" and not self.train_records:
            self.train_records = self.prepare_records(self.train_paths, "train")
            world = self.trainer.world_size if self.trainer is not None else 1
            if self.global_batch_size % world:
                raise ValueError(f"data.global_batch_size={self.global_batch_size} must be a multiple of the {world} ranks")
            self.sampler = PromptBatchSampler(len(self.train_records), self.global_batch_size, seed=self.seed)
            if self._sampler_state is not None:
                self.sampler.load_state_dict(self._sampler_state)
        if stage in ("fit", "validate") and self.eval_paths and not self.eval_records:
            self.eval_records = self.prepare_records(self.eval_paths, "eval")

    def bind(self, model: torch.nn.Module) -> RolloutBackend:
        """Build the rollout backend (once) and point it at the live policy."""
        if self.backend is None:
            self.backend = registry.build("rlflow.rollout", self.rollout_spec)
        self.backend.bind(model, self.load_tokenizer())
        return self.backend

    def train_dataloader(self) -> DataLoader:
        assert self.sampler is not None, "setup('fit') must run first"
        return DataLoader(self.train_records, batch_sampler=self.sampler, collate_fn=_keep_records, num_workers=0)

    def val_dataloader(self) -> DataLoader | list:
        if not self.eval_records:
            return []
        return DataLoader(self.eval_records, batch_size=self.eval_batch_size, shuffle=False, collate_fn=_keep_records)

    # --------------------------------------------------------------------------------------------- rollout
    def rank_share(self, batch: list[PromptRecord]) -> list[PromptRecord]:
        """This rank's prompts of a global batch: a contiguous slice, so a group never spans two ranks."""
        if self.trainer is None or self.trainer.world_size == 1:
            return batch
        per = len(batch) // self.trainer.world_size
        rank = self.trainer.global_rank
        return batch[rank * per: (rank + 1) * per]

    def judge(self, records: list[PromptRecord], completions: list[Any], k: int) -> tuple[list[float], dict[str, float], list[str]]:
        """Decode and judge ``k`` completions per record (TRL's layout: chat completions for chat prompts)."""
        tok = self.load_tokenizer()
        ids = [c.token_ids for c in completions]
        texts = tok.batch_decode(ids, skip_special_tokens=True)
        reps = [r for r in records for _ in range(k)]
        prompts = [r.prompt for r in reps]
        shaped = [[{"role": "assistant", "content": t}] if isinstance(r.prompt, list) else t for r, t in zip(reps, texts)]
        keys = sorted({key for r in records for key in r.columns})
        columns = {key: [r.columns.get(key) for r in reps] for key in keys}
        result = self.judger_runner.judge(prompts, shaped, ids, columns)
        return result.rewards, result.metrics, texts

    def make_experience(self, batch: list[PromptRecord], policy_version: int, step: int | None = None) -> dict[str, float]:
        """Generate, judge and score one rollout step; put the experience in the replay buffer; return metrics."""
        assert self.backend is not None, "bind() the policy first"
        records = self.rank_share(batch)
        k = self.prompt_repeat_k
        t0 = time.perf_counter()
        groups = self.backend.generate([r.prompt_ids for r in records], self.sampling_params(), n=k)
        gen_time = time.perf_counter() - t0
        completions = [c for group in groups for c in group]
        rewards, metrics, texts = self.judge(records, completions, k)
        reward_t = torch.tensor(rewards, dtype=torch.float32)
        advantages = self.advantage(reward_t, k)
        experiences = []
        for i, (c, r, a) in enumerate(zip(completions, rewards, advantages.tolist())):
            record = records[i // k]
            experiences.append(
                Experience(
                    prompt_ids=record.prompt_ids, completion_ids=c.token_ids, rollout_logprobs=c.logprobs,
                    reward=r, advantage=a, group=i // k, finish_reason=c.finish_reason,
                    policy_version=policy_version, data_source=record.data_source,
                )
            )
        self.buffer.add(experiences)
        lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
        group_std = reward_t.view(-1, k).std(dim=1)
        terminated = [len(c.token_ids) for c in completions if c.finish_reason == "stop"]
        metrics.update({
            "reward": reward_t.mean().item(),
            "reward_std": group_std.mean().item(),
            "frac_reward_zero_std": torch.isclose(group_std, torch.zeros_like(group_std)).float().mean().item(),
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": sum(c.finish_reason == "length" for c in completions) / len(completions),
            "completions/mean_terminated_length": sum(terminated) / len(terminated) if terminated else 0.0,
            "rollout/time": gen_time,
            "rollout/tokens_per_s": lengths.sum().item() / max(gen_time, 1e-9),
            "data/dropped_prompts": float(self.dropped["train"]),
            "num_prompt_tokens": float(sum(len(r.prompt_ids) for r in records) * k),
            "num_completion_tokens": lengths.sum().item(),
        })
        if self.log_trajectories:
            self.write_trajectories(step if step is not None else policy_version, records, texts, experiences)
        return metrics

    def write_trajectories(self, step: int, records: list[PromptRecord], texts: list[str], experiences: list[Experience]) -> None:
        log_dir = getattr(self.trainer, "log_dir", None) if self.trainer is not None else None
        if not log_dir:
            return
        rank = self.trainer.global_rank
        path = Path(log_dir) / ("trajectories.jsonl" if rank == 0 else f"trajectories.rank{rank}.jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        k = self.prompt_repeat_k
        with path.open("a", encoding="utf-8") as f:
            for i, (text, e) in enumerate(zip(texts, experiences)):
                record = records[i // k]
                f.write(json.dumps({
                    "step": step, "rank": rank, "group": e.group, "data_source": record.data_source,
                    "prompt": record.prompt_text, "completion": text, "ground_truth": record.columns.get("ground_truth"),
                    "reward": e.reward, "advantage": e.advantage, "finish_reason": e.finish_reason,
                    "num_tokens": len(e.completion_ids), "policy_version": e.policy_version,
                }, ensure_ascii=False) + "\n")

    # ------------------------------------------------------------------------------------------ evaluation
    def evaluate_batch(self, batch: list[PromptRecord]) -> dict[str, Any]:
        """Generate one completion per prompt with the evaluation sampling settings and judge it."""
        assert self.backend is not None, "bind() the policy first"
        groups = self.backend.generate([r.prompt_ids for r in batch], self.sampling_params(eval=True), n=1)
        completions = [g[0] for g in groups]
        rewards, _, _ = self.judge(batch, completions, 1)
        return {
            "rewards": rewards,
            "correct": [float(r >= self.eval_pass_threshold) for r in rewards],
            "lengths": [len(c.token_ids) for c in completions],
            "data_sources": [r.data_source for r in batch],
        }

    # -------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            "buffer": self.buffer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("sampler") is not None:
            self._sampler_state = state["sampler"]
            if self.sampler is not None:
                self.sampler.load_state_dict(self._sampler_state)
        if state.get("buffer") is not None:
            self.buffer.load_state_dict(state["buffer"])
