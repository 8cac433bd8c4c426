"""``RolloutDataModule``: prompts in, judged experience out.

The train dataloader yields *prompt batches* only, which are cheap, so Lightning's one-batch prefetch costs
nothing and cannot make training off-policy: the expensive part, :meth:`RolloutDataModule.make_experience`
(generate ``prompt_repeat_k`` completions per prompt, judge them, compute group advantages, fill the replay
buffer), is called by :class:`rlflow.module.GRPOModule` inside ``training_step``, after the previous optimizer
step, with the live policy. Every experience is stamped with the policy version that sampled it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from rlflow import registry
from rlflow.advantages.base import AdvantageEstimator, estimate
from rlflow.config_checks import check_data_args
from rlflow.data.dataset import DataError, PromptFormat, PromptRecord
from rlflow.data.mix import MixBatchSampler
from rlflow.data.overlap import generate_and_judge
from rlflow.data.sources import DataSource, SourceJudgers, parse_sources, per_source_means, read_source
from rlflow.data.experience import Experience
from rlflow.data.replay_buffer import ReplayBuffer
from rlflow.data.sampler import PromptBatchSampler, PromptLoader
from rlflow.judgers.base import Judger
from rlflow.judgers.runner import JudgerRunner
from rlflow.rollout.base import RolloutBackend, SamplingParams


def _keep_records(batch: list[PromptRecord]) -> list[PromptRecord]:
    return list(batch)


class RolloutDataModule(L.LightningDataModule):
    """Wraps the prompt datasets, the rollout backend, the judgers and the replay buffer."""

    def __init__(
        self,
        train_data_path: str | dict[str, Any] | list[str | dict[str, Any]],
        eval_data_path: str | dict[str, Any] | list[str | dict[str, Any]] | None = None,
        tokenizer_path: str | None = None,
        prompt_repeat_k: int = 8,
        global_batch_size: int = 16,
        max_prompt_length: int = 512,
        max_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        stop: list[str] | None = None,
        judgers: dict[str, str | Judger | list[str | Judger]] | None = None,
        reward_weights: dict[str, float] | None = None,
        judger_timeout: float | None = 60.0,
        advantage: str | AdvantageEstimator = "grpo",
        dynamic_sampling: bool = False,
        max_sampling_rounds: int = 3,
        rollout: str | RolloutBackend = "hf",
        system_prompt: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        prompt_template: str | None = None,
        eval_temperature: float = 0.0,
        eval_batch_size: int = 64,
        eval_pass_threshold: float = 1.0,
        eval_k: int = 1,
        seed: int = 0,
        log_trajectories: bool = True,
        overlap_judging: bool = True,
    ) -> None:
        """
        Args:
            train_data_path: Training prompts in XTuner's RL format or TRL's layout: a jsonl/JSON/parquet file, a glob,
                a directory of shards or a ``datasets.save_to_disk`` dir; or a list of sources, each a path or a mapping
                ``{path, weight, max_prompt_length, judgers, name, system_prompt, prompt_template}`` (``weight``: the
                source's share of every batch). See :class:`rlflow.data.sources.DataSource`.
            eval_data_path: Evaluation prompts, given the same way; None disables evaluation.
            tokenizer_path: Tokenizer to load; linked to ``model.model_path`` by the CLI.
            prompt_repeat_k: Completions sampled per prompt (the GRPO group size, at least 2).
            global_batch_size: Prompts per rollout step, over all ranks.
            max_prompt_length: Prompts longer than this many tokens are dropped (and counted), never truncated.
            max_tokens: Most tokens generated per completion.
            temperature: Sampling temperature of training rollouts (also used for the training log-probs).
            top_p: Nucleus sampling threshold (1.0 disables it).
            top_k: Top-k sampling (0 disables it).
            stop: Extra stop strings, each a single token of the tokenizer; the tokenizer's EOS always stops.
            judgers: Judgers per ``data_source``: a short name, an import path (a TRL-style reward function),
                ``class_path``/``init_args`` (``--data.judgers.help gsm8k`` lists a judger's options), or a list of
                these; ``*`` catches every source.
            reward_weights: Weight of each judger (by name) in the summed reward; default 1.0.
            judger_timeout: Seconds one judger may take on one batch; past it (or if it raises) its samples get no
                reward from it and are counted in ``judger/failures``. None waits forever.
            advantage: Advantage estimator: a short name of the ``rlflow.advantages`` group, an import path or
                ``class_path``/``init_args`` (``--data.advantage.help grpo`` lists its options).
            dynamic_sampling: DAPO's dynamic sampling: drop groups whose rewards all agree (no learning signal) and
                sample more prompts until the batch is full again.
            max_sampling_rounds: With dynamic sampling, most generation rounds per rollout step (the first included);
                a batch still short after them is topped up with dropped groups (advantage 0).
            rollout: Rollout backend: a short name of the ``rlflow.rollout`` group, an import path or
                ``class_path``/``init_args`` (``--data.rollout.help hf`` lists its options).
            system_prompt: If set, replaces (or adds) the system message of every chat prompt.
            chat_template_kwargs: Extra keyword arguments for the chat template (e.g. ``enable_thinking: false``).
            prompt_template: If set, plain-string prompts become ``prompt_template.format(prompt=..., **columns)``.
            eval_temperature: Temperature of evaluation rollouts; 0 is greedy.
            eval_batch_size: Prompts per evaluation batch.
            eval_pass_threshold: An evaluation completion counts as correct when its reward is at least this.
            eval_k: Completions per eval prompt: 1 (greedy by default) reports ``eval/accuracy``; k > 1 samples at
                ``eval_temperature`` (which must then be > 0) and also reports ``eval/pass@k``.
            seed: Seed of the prompt order (each epoch uses ``seed + epoch``).
            log_trajectories: Append every rollout step's samples to ``<log_dir>/trajectories.jsonl``.
            overlap_judging: With a backend that streams finished groups (``engine``), judge them in a background
                thread while the rest of the batch is still generating (same rewards and metrics as judging the
                whole batch at once); see :mod:`rlflow.data.overlap`.
        """
        check_data_args(locals())  # every invalid value is one ConfigError naming its option
        super().__init__()
        if prompt_repeat_k < 2:
            raise ValueError(
                f"data.prompt_repeat_k={prompt_repeat_k}: GRPO compares the completions of one prompt with each other, "
                "so a group needs at least 2 (a group of 1 has no mean or std to compare against); use 2 or more"
            )
        self.train_sources = parse_sources(train_data_path, "data.train_data_path")
        self.train_paths = [s.path for s in self.train_sources]
        if not self.train_paths:
            raise ValueError("data.train_data_path is empty")
        self.eval_sources = parse_sources(eval_data_path, "data.eval_data_path")
        self.eval_paths = [s.path for s in self.eval_sources]
        self.prompt_template = prompt_template
        PromptFormat(prompt_template=prompt_template)  # a bad template fails here, before any model is loaded
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
        if eval_k < 1 or (eval_k > 1 and eval_temperature == 0.0):
            raise ValueError(
                f"data.eval_k={eval_k} with data.eval_temperature={eval_temperature}: eval_k must be >= 1, and k > 1 "
                "greedy completions would all be identical; set data.eval_temperature > 0 (e.g. 0.6) or eval_k=1"
            )
        self.eval_k = eval_k
        self.seed = seed
        self.log_trajectories = log_trajectories
        self.overlap_judging = overlap_judging
        self.buffer = ReplayBuffer(seed=seed)
        self.last_samples: list[dict] = []  # the latest rollout step's samples (for the W&B samples table)
        self.rollout_progress: Any = None  # a listener with start(total), update(completions, tokens), close()
        self.tokenizer: Any = None
        self.train_records: list[PromptRecord] = []
        self.eval_records: list[PromptRecord] = []
        self.dropped: dict[str, int] = {"train": 0, "eval": 0}
        self.sampler: PromptBatchSampler | None = None
        self.backend: RolloutBackend | None = None
        # Built here, not in setup, so that a wrong plugin name fails before any model is loaded.
        self.source_judgers = SourceJudgers(
            self.judger_specs, reward_weights, [*self.train_sources, *self.eval_sources],
            timeout=judger_timeout, defaults={"max_tokens": max_tokens},
        )
        self.judger_runner: JudgerRunner = self.source_judgers.default  # sources without their own judgers
        self.source_sizes: dict[str, dict[str, int]] = {"train": {}, "eval": {}}
        self.dropped_by_source: dict[str, dict[str, int]] = {"train": {}, "eval": {}}
        self.advantage = registry.build("rlflow.advantages", advantage)
        if max_sampling_rounds < 1:
            raise ValueError(f"data.max_sampling_rounds must be >= 1, got {max_sampling_rounds}")
        self.dynamic_sampling = dynamic_sampling
        self.max_sampling_rounds = max_sampling_rounds

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

    def prompt_format(self, source: DataSource | None = None) -> PromptFormat:
        """How the prompts of ``source`` are rendered: its own system prompt / template, else the data-level ones."""
        system = self.system_prompt if source is None or source.system_prompt is None else source.system_prompt
        template = self.prompt_template if source is None or source.prompt_template is None else source.prompt_template
        return PromptFormat(system, template, self.chat_template_kwargs)

    def render_prompt(self, record: PromptRecord, source: DataSource | None = None) -> str:
        """The prompt text the model sees: chat messages through the chat template, plain strings as written
        (or through ``prompt_template``); see :class:`rlflow.data.dataset.PromptFormat`."""
        if source is None:
            source = next((s for s in (*self.train_sources, *self.eval_sources) if s.name == record.origin), None)
        return self.prompt_format(source).render(record, self.load_tokenizer())

    def prepare_records(self, paths: list[str | DataSource], split: str) -> list[PromptRecord]:
        """Read, render and tokenize every prompt of every source; drop (and count) those over the length limit."""
        tok = self.load_tokenizer()
        kept: list[PromptRecord] = []
        self.source_sizes[split], self.dropped_by_source[split] = {}, {}
        for source in parse_sources(list(paths), f"data.{split}_data_path"):
            fmt = self.prompt_format(source)
            limit = source.max_prompt_length or self.max_prompt_length
            setting = f"{source.name}.max_prompt_length={limit}" if source.max_prompt_length else f"data.max_prompt_length={limit}"
            n_kept = n_dropped = 0
            for record in read_source(source):
                record.prompt_text = fmt.render(record, tok)
                record.prompt_ids = tok(record.prompt_text, add_special_tokens=False)["input_ids"]
                if len(record.prompt_ids) > limit:
                    n_dropped += 1
                    continue
                kept.append(record)
                n_kept += 1
            if n_dropped:
                print(f"[rlflow] {split}: dropped {n_dropped} prompt(s) of {source.name} longer than {setting} tokens")
            if not n_kept:
                raise DataError(f"no usable {split} prompts in {source.path}: all {n_dropped} are longer than {setting}")
            self.source_sizes[split][source.name] = n_kept
            self.dropped_by_source[split][source.name] = n_dropped
        self.dropped[split] = sum(self.dropped_by_source[split].values())
        return kept

    def check_judgeable(self, records: list[PromptRecord], split: str) -> None:
        """Before any generation: every row has a judger for its ``data_source`` and the columns those judgers need
        (``required_columns``, e.g. gsm8k's ``ground_truth``); else one DataError naming each row's file:line."""
        problems, count = [], 0
        for record in records:
            runner = self.source_judgers.runners.get(record.origin, self.judger_runner)
            try:
                names = runner.route(record.data_source)
            except KeyError as exc:
                problem = f"{record.source}: {exc.args[0] if exc.args else exc}"
            else:
                missing = [f"judger {name!r} needs column {col!r}" for name in names
                           for col in getattr(runner.judgers[name], "required_columns", ()) if record.columns.get(col) is None]
                if not missing:
                    continue
                problem = f"{record.source}: {'; '.join(missing)}, which the row lacks (XTuner rows carry reward_model.ground_truth)"
            count += 1
            if len(problems) < 10:
                problems.append(problem)
        if problems:
            more = f"\n  ... and {count - len(problems)} more" if count > len(problems) else ""
            raise DataError(f"{count} {split} row(s) cannot be judged; fix them (or data.judgers) before training:\n  "
                            + "\n  ".join(problems) + more)

    def setup(self, stage: str) -> None:
        if stage == "fit" and not self.train_records:
            self.train_records = self.prepare_records(self.train_sources, "train")
            self.check_judgeable(self.train_records, "train")
            world = self.trainer.world_size if self.trainer is not None else 1
            if self.global_batch_size % world:
                raise ValueError(f"data.global_batch_size={self.global_batch_size} must be a multiple of the {world} ranks")
            if len(self.train_sources) > 1:  # several sources: each gets its weight's share of every batch
                sizes = self.source_sizes["train"]
                self.sampler = MixBatchSampler(
                    [sizes[s.name] for s in self.train_sources], [s.weight for s in self.train_sources],
                    self.global_batch_size, seed=self.seed, names=[s.name for s in self.train_sources],
                )
            else:
                self.sampler = PromptBatchSampler(len(self.train_records), self.global_batch_size, seed=self.seed)
        if stage in ("fit", "validate") and self.eval_paths and not self.eval_records:
            self.eval_records = self.prepare_records(self.eval_sources, "eval")
            self.check_judgeable(self.eval_records, "eval")

    def bind(self, model: torch.nn.Module) -> RolloutBackend:
        """Build the rollout backend (once) and point it at the live policy."""
        if self.backend is None:
            self.backend = registry.build("rlflow.rollout", self.rollout_spec)
        self.backend.bind(model, self.load_tokenizer())
        return self.backend

    def train_dataloader(self) -> DataLoader:
        assert self.sampler is not None, "setup('fit') must run first"
        # Own generators: a DataLoader draws its base seed from the global RNG otherwise, which a resumed run
        # would not replay. PromptLoader checkpoints the sampler's position (see rlflow.data.sampler).
        return PromptLoader(self.train_records, batch_sampler=self.sampler, collate_fn=_keep_records, num_workers=0,
                            generator=torch.Generator().manual_seed(self.seed))

    def val_dataloader(self) -> DataLoader | list:
        if not self.eval_records:
            return []
        return DataLoader(self.eval_records, batch_size=self.eval_batch_size, shuffle=False, collate_fn=_keep_records,
                          generator=torch.Generator().manual_seed(self.seed))

    # --------------------------------------------------------------------------------------------- rollout
    def rank_share(self, batch: list[PromptRecord]) -> list[PromptRecord]:
        """This rank's prompts of a global batch: a contiguous slice, so a group never spans two ranks."""
        if self.trainer is None or self.trainer.world_size == 1:
            return batch
        per = len(batch) // self.trainer.world_size
        rank = self.trainer.global_rank
        return batch[rank * per: (rank + 1) * per]

    def batch_advantages(self, rewards: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
        """This rank's advantages, estimated over the whole generation batch of every rank.

        Groups never span ranks, but batch-level estimators (``scale_rewards: batch``) need every rank's rewards:
        they are gathered in rank order (the global batch's order), scored, and this rank's slice is kept.
        """
        from rlflow.distributed import all_gather, world_size

        if world_size() == 1:
            return estimate(self.advantage, rewards, k, lengths=lengths)
        n, rank = rewards.numel(), self.trainer.global_rank
        everything = estimate(self.advantage, all_gather(rewards), k, lengths=all_gather(lengths))
        return everything[rank * n: (rank + 1) * n]

    def judge(self, records: list[PromptRecord], completions: list[Any], k: int) -> tuple[list[float], dict[str, float], list[str]]:
        """Decode and judge ``k`` completions per record (TRL's layout: chat completions for chat prompts)."""
        result, texts = self.judge_result(records, completions, k)
        return result.rewards, result.metrics, texts

    def judge_result(self, records: list[PromptRecord], completions: list[Any], k: int) -> tuple[Any, list[str]]:
        """:meth:`judge`'s :class:`~rlflow.judgers.runner.JudgeResult` (with per-judger values) and decoded texts."""
        tok = self.load_tokenizer()
        ids = [c.token_ids for c in completions]
        texts = tok.batch_decode(ids, skip_special_tokens=True)
        reps = [r for r in records for _ in range(k)]
        prompts = [r.prompt for r in reps]
        shaped = [[{"role": "assistant", "content": t}] if isinstance(r.prompt, list) else t for r, t in zip(reps, texts)]
        keys = sorted({key for r in records for key in r.columns})
        columns = {key: [r.columns.get(key) for r in reps] for key in keys}
        result = self.source_judgers.judge([r.origin for r in reps], prompts, shaped, ids, columns, default=self.judger_runner)
        return result, texts

    def generate_with_progress(self, prompt_ids: list[list[int]], params: SamplingParams, n: int) -> list[list[Any]]:
        """``backend.generate``, reporting to ``rollout_progress`` (per batch where ``generate`` takes ``progress=``)."""
        listener = self.rollout_progress
        if listener is None:
            return self.backend.generate(prompt_ids, params, n=n)
        listener.start(len(prompt_ids) * n)
        try:
            if "progress" in inspect.signature(self.backend.generate).parameters:
                return self.backend.generate(prompt_ids, params, n=n, progress=listener.update)
            groups = self.backend.generate(prompt_ids, params, n=n)
            listener.update(sum(len(g) for g in groups), sum(len(c.token_ids) for g in groups for c in g))
            return groups
        finally:
            listener.close()

    def make_experience(self, batch: list[PromptRecord], policy_version: int, step: int | None = None) -> dict[str, float]:
        """Generate, judge and score one rollout step; put the experience in the replay buffer; return metrics."""
        assert self.backend is not None, "bind() the policy first"
        if self.sampler is not None:
            self.sampler.mark_consumed()  # its checkpointed position follows trained batches, not prefetched ones
        records = self.rank_share(batch)
        k = self.prompt_repeat_k
        groups, rewards, metrics, texts, gen_time = generate_and_judge(self, records, self.sampling_params(), k)
        completions = [c for group in groups for c in group]
        if self.dynamic_sampling:
            records, completions, rewards, texts, extra_time = self.dynamic_sample(records, completions, rewards, texts, step, metrics)
            gen_time += extra_time
        reward_t = torch.tensor(rewards, dtype=torch.float32)
        advantages = self.batch_advantages(reward_t, torch.tensor([len(c.token_ids) for c in completions]), k)
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
        metrics.update(per_source_means([r.data_source or r.origin for r in records for _ in range(k)], rewards, "reward"))
        self.last_samples = self.trajectory_rows(step if step is not None else policy_version, records, texts, experiences)
        if self.log_trajectories:
            self.write_trajectories(self.last_samples)
        return metrics

    def dynamic_sample(self, records: list[PromptRecord], completions: list[Any], rewards: list[float], texts: list[str],
                       step: int | None, metrics: dict[str, float]) -> tuple[list, list, list, list, float]:
        """DAPO's dynamic sampling: keep the groups whose rewards differ, draw more prompts until the batch is full.

        Extra prompts are drawn at random from the training set with a seed of (``seed``, step, round, rank), so a
        resumed run draws the same ones. Every rank runs the same number of rounds (a rank whose batch is full
        keeps sampling while another's is short), and the batch keeps its size (ranks must take the same number of
        steps): if it is still short after ``max_sampling_rounds`` rounds it is topped up with dropped groups.
        """
        k, target = self.prompt_repeat_k, len(records)
        kept: list[tuple] = []
        dropped: list[tuple] = []
        rounds, drawn, extra_time = 0, 0, 0.0
        while True:
            rounds += 1
            drawn += len(records)
            for g, record in enumerate(records):
                part = slice(g * k, (g + 1) * k)
                group = (record, completions[part], rewards[part], texts[part])
                (kept if max(rewards[part]) - min(rewards[part]) > 1e-6 else dropped).append(group)
            short = float(len(kept) < target)
            if self.trainer is not None and self.trainer.world_size > 1:  # every rank runs the same rounds
                strategy = self.trainer.strategy
                short = float(strategy.reduce(torch.tensor(short, device=strategy.root_device), reduce_op="sum"))
            if not short or rounds >= self.max_sampling_rounds:
                break
            rank = self.trainer.global_rank if self.trainer is not None else 0
            gen = torch.Generator().manual_seed(self.seed + 7919 * ((step or 0) + 1) + 104729 * rounds + 1299709 * rank)
            records = [self.train_records[i] for i in torch.randint(len(self.train_records), (target,), generator=gen).tolist()]
            t0 = time.perf_counter()
            groups = self.backend.generate([r.prompt_ids for r in records], self.sampling_params(), n=k)
            extra_time += time.perf_counter() - t0
            completions = [c for group in groups for c in group]
            rewards, _, texts = self.judge(records, completions, k)
        padded = max(target - len(kept), 0)
        chosen = kept[:target] + dropped[:padded]
        metrics.update({
            "sampling/rounds": float(rounds), "sampling/groups_drawn": float(drawn),
            "sampling/groups_dropped": float(len(dropped)), "sampling/groups_padded": float(padded),
        })
        return (
            [g[0] for g in chosen], [c for g in chosen for c in g[1]], [r for g in chosen for r in g[2]],
            [t for g in chosen for t in g[3]], extra_time,
        )

    def trajectory_rows(self, step: int, records: list[PromptRecord], texts: list[str], experiences: list[Experience]) -> list[dict]:
        """One dict per sample of a rollout step (trajectories.jsonl's rows; also the W&B samples table's)."""
        rank = self.trainer.global_rank if self.trainer is not None else 0
        k = self.prompt_repeat_k
        return [{
            "step": step, "rank": rank, "group": e.group, "data_source": records[i // k].data_source,
            "prompt": records[i // k].prompt_text, "completion": text,
            "ground_truth": records[i // k].columns.get("ground_truth"),
            "reward": e.reward, "advantage": e.advantage, "finish_reason": e.finish_reason,
            "num_tokens": len(e.completion_ids), "policy_version": e.policy_version,
        } for i, (text, e) in enumerate(zip(texts, experiences))]

    def write_trajectories(self, rows: list[dict]) -> None:
        log_dir = getattr(self.trainer, "log_dir", None) if self.trainer is not None else None
        if not log_dir or not rows:
            return
        rank = rows[0]["rank"]
        path = Path(log_dir) / ("trajectories.jsonl" if rank == 0 else f"trajectories.rank{rank}.jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")

    # ------------------------------------------------------------------------------------------ evaluation
    def evaluate_batch(self, batch: list[PromptRecord], seed: int | None = None) -> dict[str, Any]:
        """Generate ``eval_k`` completions per prompt with the evaluation sampling settings and judge them.

        Sampling runs on a forked RNG seeded with ``seed`` (see :func:`rlflow.evaluation.isolated_rng`), so it
        never moves the training random stream. Returns per prompt lists of ``eval_k`` rewards, correctness
        flags and lengths, and the prompts' data sources.
        """
        from rlflow.evaluation import isolated_rng

        assert self.backend is not None, "bind() the policy first"
        k = self.eval_k
        with isolated_rng(self.seed if seed is None else seed):
            groups = self.backend.generate([r.prompt_ids for r in batch], self.sampling_params(eval=True), n=k)
        completions = [c for group in groups for c in group]
        rewards, _, _ = self.judge(batch, completions, k)
        per_prompt = [rewards[i * k: (i + 1) * k] for i in range(len(batch))]
        return {
            "rewards": per_prompt,
            "correct": [[r >= self.eval_pass_threshold for r in group] for group in per_prompt],
            "lengths": [[len(c.token_ids) for c in g] for g in groups],
            "data_sources": [r.data_source for r in batch],
        }

    # -------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The replay buffer, as plain types (``torch.load(weights_only=True)`` reads it); the sampler's position
        is saved by Lightning through :class:`PromptLoader`."""
        buffer = self.buffer.state_dict()
        return {"buffer": {**buffer, "items": [dataclasses.asdict(e) for e in buffer["items"]]}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("buffer") is not None:
            buffer = state["buffer"]
            self.buffer.load_state_dict({**buffer, "items": [Experience(**e) for e in buffer["items"]]})
