"""``RolloutDataModule``: prompts in, judged experience out, as a composition of named parts.

Each part is its own module with its own interface; the datamodule only wires them together:

* prompts: :class:`~rlflow.data.prompts.PromptSet` per split (sources read, rendered, tokenized, filtered) and
  its seeded batch sampler (:mod:`rlflow.data.sampler`, :mod:`rlflow.data.mix`);
* generation: the rollout backend (:class:`~rlflow.rollout.base.RolloutBackend`, the ``rlflow.rollout`` group);
* rewards: the :class:`~rlflow.judgers.panel.JudgePanel` (the ``rlflow.judgers`` group), judging overlapped
  with generation where the backend streams (:mod:`rlflow.judgers.overlap`);
* advantages: the estimator (the ``rlflow.advantages`` group) over every rank's batch;
* :class:`~rlflow.data.dynamic_sampling.DynamicSampling` (optional) and the
  :class:`~rlflow.data.replay_buffer.ReplayBuffer`;
* multi-turn rollouts (optional, with ``tools`` or an ``environment``): :class:`~rlflow.rollout.multiturn.MultiTurn`
  drives the backend turn by turn (:mod:`rlflow.rollout.multiturn`).

Writers (``trajectories.jsonl``, the W&B samples table, the summary line) are callbacks that read the
:class:`~rlflow.data.experience.RolloutStep` the module keeps (:mod:`rlflow.training.callbacks`).

The train dataloader yields *prompt batches* only, which are cheap, so Lightning's one-batch prefetch costs
nothing and cannot make training off-policy: the expensive part, :meth:`RolloutDataModule.make_experience`, is
called by :class:`rlflow.training.module.GRPOModule` inside ``training_step``, after the previous optimizer step,
with the
live policy, through the :class:`~rlflow.data.protocol.ExperienceSource` interface. Every experience is stamped
with the policy version that sampled it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from rlflow import registry
from rlflow.advantages.base import AdvantageEstimator, estimate_global
from rlflow.config_checks import check_data_args
from rlflow.config_error import ConfigError
from rlflow.data.dataset import PromptRecord
from rlflow.data.dynamic_sampling import DynamicSampling, Groups
from rlflow.data.experience import Experience, RolloutStep
from rlflow.data.mix import MixBatchSampler
from rlflow.data.prompts import PromptSet
from rlflow.data.replay_buffer import ReplayBuffer
from rlflow.data.rollout_metrics import rollout_metrics
from rlflow.data.sampler import PromptBatchSampler, PromptLoader
from rlflow.data.sources import parse_sources, per_source_means
from rlflow.judgers.base import Judger
from rlflow.judgers.overlap import generate_and_judge
from rlflow.judgers.panel import JudgePanel
from rlflow.log import info
from rlflow.models.vision import ImageInputs, any_images, check_backend_accepts_images, load_processor, rollout_prompts
from rlflow.rollout import prestart
from rlflow.rollout.base import RolloutBackend, SamplingParams, pad_with_eos, stop_token_ids
from rlflow.rollout.draws import isolated_draws
from rlflow.rollout.multiturn import MultiTurn, RecordsRollout, multiturn_metrics
from rlflow.rollout.pipeline import make_pipeline, worker_spec
from rlflow.rollout.process import GeneratorProcess
from rlflow.rollout.select import resolve_backend
from rlflow.rollout.split import SplitRollout, split_problem
from rlflow.training.distributed import all_gather, is_sharded
from rlflow.training.evaluation import eval_seed, isolated_rng


def _keep_records(batch: list[PromptRecord]) -> list[PromptRecord]:
    return list(batch)


class RolloutDataModule(L.LightningDataModule):
    """Wraps the prompt sets, the rollout backend, the judge panel, the advantage estimator and the replay buffer."""

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
        min_p: float = 0.0,
        repetition_penalty: float = 1.0,
        stop: list[str] | None = None,
        judgers: dict[str, str | Judger | list[str | Judger]] | None = None,
        reward_weights: dict[str, float] | None = None,
        judger_timeout: float | None = 60.0,
        advantage: str | AdvantageEstimator = "grpo",
        dynamic_sampling: bool = False,
        skip_solved: bool = False,
        max_sampling_rounds: int = 3,
        rollout: str | RolloutBackend = "auto",
        system_prompt: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        prompt_template: str | None = None,
        eval_temperature: float = 0.0,
        eval_batch_size: int = 64,
        eval_pass_threshold: float = 1.0,
        eval_k: int = 1,
        seed: int = 0,
        overlap_judging: bool = True,
        tools: list[str] | None = None,
        tool_parser: str = "hermes",
        tool_timeout: float | None = 30.0,
        environment: str | dict[str, Any] | None = None,
        max_turns: int = 4,
        max_staleness: int = 0,
        stale_policy: str = "regenerate",
        generator_threads: int = 1,
        partial_rollouts: bool = False,
        partial_swap_step: int = 0,
        lend_cores: bool = True,
        split_rollout: bool = False,
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
            min_p: Min-p sampling: keep the tokens whose probability is at least ``min_p`` times the most likely
                token's (0 disables it; applied after top-k and top-p, as transformers and vLLM do). Like them,
                it truncates the sampling distribution only: the log-probs the trainer uses are the policy's.
            repetition_penalty: Repetition penalty of training rollouts (transformers', vLLM's and LMDeploy's; 1.0
                disables it): the logit of a token already in the prompt or the completion is divided by it where
                positive and multiplied where negative, before the temperature. The rollout log-probs are those of
                the penalised distribution (vLLM's ``processed_logprobs``, as TRL uses), so ``model.rollout_is``
                corrects for it; evaluation samples without it (:mod:`rlflow.rollout.penalty`).
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
            skip_solved: Leave out of later epochs the prompts whose last group was solved (every completion's
                reward at least ``eval_pass_threshold``), as Skywork-OR1 and POLARIS filter by pass rate: such a group
                has zero advantages and costs a rollout. One training source only (not a weighted mix).
            max_sampling_rounds: With dynamic sampling, most generation rounds per rollout step (the first included);
                a batch still short after them is topped up with dropped groups (advantage 0).
            rollout: Rollout backend: ``auto`` (the default: the ``engine`` backend where it can run the model,
                else ``hf``, with the reason logged; see :mod:`rlflow.rollout.select`), a short name of the
                ``rlflow.rollout`` group, an import path or ``class_path``/``init_args`` (``--data.rollout.help
                engine`` lists its options). A backend named explicitly that cannot run the model is an error.
            system_prompt: If set, replaces (or adds) the system message of every chat prompt.
            chat_template_kwargs: Extra keyword arguments for the chat template (e.g. ``enable_thinking: false``).
            prompt_template: If set, plain-string prompts become ``prompt_template.format(prompt=..., **columns)``.
            eval_temperature: Temperature of evaluation rollouts; 0 is greedy.
            eval_batch_size: Prompts per evaluation batch.
            eval_pass_threshold: An evaluation completion counts as correct when its reward is at least this.
            eval_k: Completions per eval prompt: 1 (greedy by default) reports ``eval/accuracy``; k > 1 samples at
                ``eval_temperature`` (which must then be > 0) and also reports ``eval/pass@k`` (and ``pass@2``,
                ``@4``, ... below k) and ``eval/maj@k`` (majority vote, from judgers that state answers).
            seed: Seed of the prompt order (each epoch uses ``seed + epoch``).
            overlap_judging: With a backend that streams finished groups (``engine``), judge them in a background
                thread while the rest of the batch is still generating (same rewards and metrics as judging the
                whole batch at once); see :mod:`rlflow.judgers.overlap`. Pays for slow judgers (remote, math
                verification); a judger of a few microseconds a sample is faster after generation, since its thread
                contends with the decode loop for the GIL (the CPU demo: ~4% of a step; it sets ``false``).
            tools: Tools the policy may call, each an import path (``my_pkg.tools:search``, a TRL-style typed function
                with a Google docstring) or a short name of the ``rlflow.tools`` group (``calculator``, ``python``);
                from Python, the functions themselves.
                Their schemas reach the chat template (``tools=``) and rollouts become multi-turn: ``max_tokens`` is
                then the budget of the whole trajectory; see :mod:`rlflow.rollout.multiturn`.
            tool_parser: How tool calls are found in a completion: a short name of ``rlflow.tool_parsers``
                (``hermes``: ``<tool_call>{json}</tool_call>``) or an import path.
            tool_timeout: Seconds one tool call may take; past it (or if the tool raises, or gets bad arguments) the
                model gets an error message as the tool's result, counted in ``tools/failure_frequency``.
            environment: A multi-turn environment (``rlflow.environments`` short name, import path or
                ``class_path``/``init_args``), one instance per trajectory; see :mod:`rlflow.environments.base`.
            max_turns: Most model turns per trajectory in multi-turn rollouts.
            max_staleness: Pipelined GRPO: 0 (the default) is the strictly on-policy loop; N > 0 generates the next
                rollout step in a separate process while the trainer updates on this one, and trains on an
                experience only while ``trained version - sampling version <= N`` policy versions (the one-step
                pipeline's staleness is ``model.optimizer_steps x model.num_iterations``); turns the rollout
                importance-sampling correction on unless ``model.rollout_is: off``. See :mod:`rlflow.rollout.pipeline`.
            stale_policy: With ``max_staleness > 0``, experience beyond the bound is ``drop``-ped (counted) or
                ``regenerate``-d from the current weights (counted).
            generator_threads: With ``max_staleness > 0``, torch threads of the generator process.
            partial_rollouts: With ``max_staleness > 0`` (engine backend, one process): the look-ahead job takes the
                trainer's next weights at decode iteration ``partial_swap_step`` and continues its unfinished
                completions under them from their KV caches, each token stamped with the version that sampled it
                (trajectories' ``token_versions``); staleness is the oldest token's. See docs/pipelining.md.
            partial_swap_step: The decode iteration of that swap (0: half of ``max_tokens``).
            lend_cores: With ``max_staleness > 0`` on a CPU, where the trainer's threads were cut to leave the
                generator process its cores: the backward pass and evaluation take them back while the generator
                waits between two decode iterations (engine backend). Faster where training is the larger part of a
                step (the demo); ``false`` where generation is (longer completions, bigger models). Either way
                the threads depend on the phase, not on timing, so runs stay reproducible.
            split_rollout: With ``max_staleness: 0`` (ignored, with a log line, when pipelined or multi-turn), the
                engine backend and a policy on a CPU (one process, more than ``generator_threads`` torch threads): the
                generator process (``generator_threads``) decodes the second half of each rollout's prompts while
                the trainer decodes the first half on the rest of its threads, both from the trainer's random
                streams, so the completions are those of one process (see :mod:`rlflow.rollout.split`). Faster where a
                decode step's small operators leave a second core idle (small models); the generator idles
                meanwhile.
        """
        check_data_args(locals())  # every invalid value is one ConfigError naming its option
        super().__init__()
        if prompt_repeat_k < 2:
            raise ValueError(
                f"data.prompt_repeat_k={prompt_repeat_k}: GRPO compares the completions of one prompt with each other, "
                "so a group needs at least 2 (a group of 1 has no mean or std to compare against); use 2 or more"
            )
        if eval_k < 1 or (eval_k > 1 and eval_temperature == 0.0):
            raise ValueError(
                f"data.eval_k={eval_k} with data.eval_temperature={eval_temperature}: eval_k must be >= 1, and k > 1 "
                "greedy completions would all be identical; set data.eval_temperature > 0 (e.g. 0.6) or eval_k=1"
            )
        train_sources = parse_sources(train_data_path, "data.train_data_path")
        if not train_sources:
            raise ValueError("data.train_data_path is empty")
        eval_sources = parse_sources(eval_data_path, "data.eval_data_path")
        from rlflow.tools.base import load_tools

        self.tools = load_tools(tools)
        if self.tools:  # the prompts are rendered with the tools' schemas, as the multi-turn messages are
            chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": [t.schema for t in self.tools.values()]}
        self.multiturn_args = dict(parser=tool_parser, environment=environment, max_turns=max_turns,
                                   tool_timeout=tool_timeout, chat_template_kwargs=chat_template_kwargs)
        self.multiturn: MultiTurn | None = None  # built with the tokenizer
        if self.tools or environment is not None:  # a wrong parser/environment/max_turns fails before any model loads
            MultiTurn(None, self.tools, **self.multiturn_args)
        formats = dict(system_prompt=system_prompt, prompt_template=prompt_template,
                       chat_template_kwargs=chat_template_kwargs)
        # the parts, built here so that a wrong plugin name or setting fails before any model is loaded
        self.train_prompts = PromptSet(train_sources, "train", max_prompt_length, **formats)
        self.eval_prompts = PromptSet(eval_sources, "eval", max_prompt_length, **formats)
        self.sampling = SamplingParams(temperature, top_p, top_k, max_tokens, min_p=min_p,  # stop ids: tokenizer
                                       repetition_penalty=repetition_penalty)
        self.eval_sampling = SamplingParams(eval_temperature, 1.0, 0, max_tokens)
        self.judges = JudgePanel(judgers if judgers is not None else {"openai/gsm8k": "gsm8k"}, reward_weights,
                                 [*train_sources, *eval_sources], timeout=judger_timeout, max_tokens=max_tokens)
        self.advantage = registry.build("rlflow.advantages", advantage)
        dynamic = DynamicSampling(max_sampling_rounds, seed)  # validated even when off
        self.dynamic_sampling = dynamic if dynamic_sampling else None
        if self.dynamic_sampling is not None and self.needs_components:
            raise ConfigError("data.advantage=gdpo normalises each judger's rewards apart; data.dynamic_sampling "
                              "filters groups by their summed reward: use one or the other")
        self.buffer = ReplayBuffer(seed=seed)
        self.rollout_spec = rollout
        self.backend: RolloutBackend | None = None
        self._rollout_rng: dict[str, Any] | None = None  # a checkpoint's engine draw state, until bind() applies it
        self.sampler: PromptBatchSampler | MixBatchSampler | None = None
        self.rollout_progress: Any = None  # a listener with start(total), update(completions, tokens), close()
        self.tokenizer: Any = None
        # a vision-language model's processor (rlflow.models.vision); None for text-only models
        self.processor: Any = None
        self.image_inputs: ImageInputs | None = None
        self.tokenizer_path = tokenizer_path
        self.stop = list(stop or [])
        self.prompt_repeat_k = prompt_repeat_k
        self.global_batch_size = global_batch_size
        self.eval_batch_size = eval_batch_size
        self.eval_pass_threshold = eval_pass_threshold
        self.eval_k = eval_k
        self.seed = seed
        self.skip_solved = skip_solved
        self._record_index: dict[int, int] | None = None  # id(train record) -> its index (skip_solved)
        self.overlap_judging = overlap_judging
        self.max_staleness = max_staleness
        if split_rollout and (max_staleness or tools or environment is not None):
            why = f"data.max_staleness={max_staleness}: the generator process generates ahead instead" \
                if max_staleness else "multi-turn rollouts (data.tools, data.environment) are not split"
            info(f"data.split_rollout is off for this run: {why}")
            split_rollout = False
        self.split_rollout, self.generator_threads = split_rollout, generator_threads
        self.split: SplitRollout | None = None  # data.split_rollout: the backend of fit's rollouts (bind)
        self._split_generator: GeneratorProcess | None = None  # started in setup("fit"), attached in bind
        self.pipeline = make_pipeline(max_staleness, stale_policy, generator_threads, seed, dynamic_sampling,
                                      multiturn=bool(tools) or environment is not None,
                                      partial_rollouts=partial_rollouts, partial_swap_step=partial_swap_step,
                                      lend_cores=lend_cores)

    # ----------------------------------------------------------------------------------------------- set-up
    def load_tokenizer(self) -> Any:
        """The policy's tokenizer (loaded once); its EOS and ``data.stop`` become the stop tokens."""
        if self.tokenizer is None:
            from transformers import AutoTokenizer

            if self.tokenizer_path is None:
                raise ValueError("data.tokenizer_path is not set (the CLI links it to model.model_path)")
            if not Path(self.tokenizer_path).exists() and self.tokenizer_path.startswith((".", "/", "~")):
                raise FileNotFoundError(f"tokenizer path {self.tokenizer_path!r} does not exist")
            self.processor = load_processor(self.tokenizer_path)  # None unless the model is a VLM
            if self.processor is not None:
                self.image_inputs = ImageInputs(self.processor, cache_size=0)  # each prompt processed once a step
            tokenizer = pad_with_eos(self.processor.tokenizer if self.processor is not None else
                                     AutoTokenizer.from_pretrained(self.tokenizer_path))
            stops = stop_token_ids(tokenizer, self.stop)
            self.sampling.stop_token_ids = self.eval_sampling.stop_token_ids = stops
            self.tokenizer = self.judges.tokenizer = tokenizer
            if self.tools or self.multiturn_args["environment"] is not None:
                self.multiturn = MultiTurn(tokenizer, self.tools, **self.multiturn_args)
        return self.tokenizer

    @property
    def train_records(self) -> list[PromptRecord]:
        return self.train_prompts.records

    @property
    def eval_records(self) -> list[PromptRecord]:
        return self.eval_prompts.records

    @property
    def eval_data_sources(self) -> list[str | None]:
        return sorted({r.data_source or "unknown" for r in self.eval_records})

    @property
    def rank(self) -> int:
        return self.trainer.global_rank if self.trainer is not None else 0

    @property
    def world_size(self) -> int:
        return self.trainer.world_size if self.trainer is not None else 1

    def all_cores(self) -> contextlib.AbstractContextManager:
        """Where the trainer runs its backward pass and evaluation: pipelined on a CPU, with the generator
        process's cores lent to it (:meth:`RolloutPipeline.all_cores`); otherwise as it is."""
        return self.pipeline.all_cores() if self.pipeline is not None else contextlib.nullcontext()

    def split_problem(self, backend: RolloutBackend | None = None) -> str | None:
        """Why ``data.split_rollout`` cannot run here (:func:`rlflow.rollout.split.split_problem`), None if it can."""
        strategy = self.trainer.strategy if self.trainer is not None else None
        return split_problem(self.generator_threads, self.world_size, strategy is not None and is_sharded(strategy),
                             strategy.root_device.type if strategy is not None else "cpu", backend)

    def setup(self, stage: str) -> None:
        # data.split_rollout: its generator process starts now, unless the run's settings already rule the split
        # out (bind() says why, with the backend known)
        split = stage == "fit" and self.split_rollout and self.split_problem() is None
        if self.pipeline is None and not split:
            prestart.discard()  # `rlflow fit` predicted a run with a generator process; it is not one
        if split and self._split_generator is None and self.split is None:
            self._split_generator = GeneratorProcess(self.generator_threads, tokenizer_path=self.tokenizer_path)
        if stage == "fit" and self.sampler is None and self.pipeline is not None:
            # data.max_staleness > 0: the generator process starts first, so that its imports and tokenizer
            # overlap everything the trainer loads before the first step
            self.pipeline.prestart(self.tokenizer_path)
        tokenizer = self.load_tokenizer()
        if stage == "fit" and self.sampler is None:
            self.judges.check_rows(self.train_prompts.load(tokenizer, self.processor), "train")
            if self.global_batch_size % self.world_size:
                raise ValueError(f"data.global_batch_size={self.global_batch_size} must be a multiple of the "
                                 f"{self.world_size} ranks")
            self.sampler = self.train_prompts.sampler(self.global_batch_size, self.seed, self.skip_solved)
        if stage in ("fit", "validate") and self.eval_prompts.sources and not self.eval_records:
            self.judges.check_rows(self.eval_prompts.load(tokenizer, self.processor), "eval")

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

    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """A batch is prompt records (token id lists, columns), with nothing to move: handed over as is.
        Lightning's default walks (and copies) every record and token id of every batch, each step."""
        return batch

    # ------------------------------------------------------------------------ the ExperienceSource interface
    def bind(self, policy: torch.nn.Module) -> RolloutBackend:
        """Build the rollout backend (once; ``auto`` chooses it for ``policy``) and point it at the live policy."""
        if self.backend is None:
            self.backend = resolve_backend(self.rollout_spec, policy, self.load_tokenizer())
            if self._rollout_rng is not None and hasattr(self.backend, "load_rng_state"):
                self.backend.load_rng_state(self._rollout_rng)  # a resumed run: continue a seeded engine's draws
            check_backend_accepts_images(self.backend, self.train_records + self.eval_records)
            if self.pipeline is not None and any_images(self.train_records):
                raise ConfigError(f"prompts with images are not pipelined: set data.max_staleness=0 (got "
                                  f"{self.max_staleness})")
        else:
            self.backend.bind(policy, self.load_tokenizer())
        if self.pipeline is not None and self.trainer is not None and self.trainer.state.fn == "fit":
            self.pipeline.start(self)  # data.max_staleness > 0: the generator starts up alongside the trainer
        if self.split_rollout and self.split is None and self.trainer is not None and self.trainer.state.fn == "fit":
            problem = self.split_problem(self.backend)
            if problem:
                info(f"data.split_rollout is off for this run: {problem}")
                self.split_rollout = False
                if self._split_generator is not None:
                    self._split_generator.close()
                    self._split_generator = None
            else:
                self.split = SplitRollout(self.backend, self.generator_threads, self._split_generator)
                self._split_generator = None
                self.split.attach(self.tokenizer_path, worker_spec(self))
                info(f"data.split_rollout: the generator process decodes half of each rollout's prompts on "
                     f"{self.generator_threads} torch thread(s), the trainer the other half on "
                     f"{self.split.local_threads}")
        return self.backend

    def rollout_prompts(self, records: list[PromptRecord]) -> list[list[int]]:
        """What the backend is given for ``records``: token ids, with the images of prompts that have any."""
        return rollout_prompts(records, self.image_inputs)

    @property
    def reads_policy_weights(self) -> bool:
        return self.backend is None or self.backend.reads_policy_weights

    def sync_weights(self) -> None:
        # pipelined: weights reach the generator between its jobs (rlflow.rollout.pipeline)
        if self.pipeline is not None:
            return
        if self.backend is not None:
            self.backend.sync_weights()

    def minibatches(self, num: int) -> list[list[Experience]]:
        return self.buffer.drain(num)

    @property
    def needs_components(self) -> bool:
        """Whether the advantage estimator reads each judger's reward (GDPO), not only their weighted sum."""
        return bool(getattr(self.advantage, "needs_components", False))

    def reward_components(self, per_judger: dict[str, list[float | None]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N, judgers]`` rewards of every configured judger (NaN where it gave none) and their weights."""
        weights = self.judges.weights()
        n = len(next(iter(per_judger.values()))) if per_judger else 0
        columns = [[float("nan") if v is None else float(v) for v in per_judger.get(name, [None] * n)]
                   for name in weights]
        return (torch.tensor(columns, dtype=torch.float32).t().reshape(n, len(weights)),
                torch.tensor(list(weights.values()), dtype=torch.float32))

    def make_experience(self, batch: list[PromptRecord], policy_version: int, step: int) -> RolloutStep:
        """Generate, judge and score one rollout step; put the experience in the replay buffer."""
        assert self.backend is not None, "bind() the policy first"
        if self.sampler is not None:
            self.sampler.mark_consumed()  # its checkpointed position follows trained batches, not prefetched ones
        k = self.prompt_repeat_k
        records = self.rank_share(batch)
        backend, pipelined = self.rollout_backend(records), {}
        if self.pipeline is not None:  # data.max_staleness > 0: generated ahead, in another process
            backend, policy_version, pipelined = self.pipeline.take(self, records, policy_version, step)
        groups, judged, texts, gen_time = generate_and_judge(
            backend, self.judges.judge, records, self.sampling, k, self.overlap_judging, self.rollout_progress,
            prompts=self.rollout_prompts(records))
        metrics = dict(judged.metrics)
        chosen = Groups(records, [c for group in groups for c in group], judged.rewards, texts, judged.failed)
        if self.dynamic_sampling is not None:
            chosen, sampling_metrics, extra_time = self.dynamic_sampling.fill(
                chosen, k, step, self.rank, len(self.train_records), self.regenerate, self.any_rank_short)
            metrics.update(sampling_metrics)
            gen_time += extra_time
        reward_t = torch.tensor(chosen.rewards, dtype=torch.float32)
        lengths = torch.tensor([c.num_sampled for c in chosen.completions])
        components = self.reward_components(judged.per_judger) if self.needs_components else None
        advantages = estimate_global(self.advantage, reward_t, k, lengths=lengths, components=components).tolist()
        experiences = [
            Experience(
                prompt_ids=c.prompt_ids or chosen.records[i // k].prompt_ids, completion_ids=c.token_ids,
                rollout_logprobs=c.logprobs, sampled_mask=c.mask,
                reward=chosen.rewards[i], advantage=advantages[i], group=i // k, finish_reason=c.finish_reason,
                policy_version=min(c.token_versions) if c.token_versions else policy_version,
                data_source=chosen.records[i // k].data_source, images=chosen.records[i // k].images,
                token_versions=c.token_versions,
                info={"judgers_failed": list(chosen.failed[i])} if chosen.failed and chosen.failed[i] else {},
            ) for i, c in enumerate(chosen.completions)
        ]
        self.buffer.add(experiences)
        metrics.update(rollout_metrics(reward_t, chosen.completions, k,
                                       sum(len(r.prompt_ids) for r in chosen.records) * k, gen_time))
        metrics.update(multiturn_metrics(chosen.completions))
        metrics.update(pipelined)
        metrics["data/dropped_prompts"] = float(self.train_prompts.dropped)
        if self.skip_solved:  # the step's own prompts as first judged (dynamic sampling drops solved groups)
            metrics.update(self.record_solved(records, judged.rewards))
        sources = [r.data_source or r.origin for r in chosen.records for _ in range(k)]
        metrics.update(per_source_means(sources, chosen.rewards, "reward"))
        return RolloutStep(experiences, metrics, self.sample_rows(step, chosen.records, chosen.texts, experiences))

    def record_solved(self, records: list[PromptRecord], rewards: list[float]) -> dict[str, float]:
        """``skip_solved``: tell the sampler which of every rank's groups were solved (all ``k`` rewards at least
        ``eval_pass_threshold``; ``records`` is this rank's share of the batch, a collective); returns
        ``data/solved_prompts`` (marked so far) and ``data/skipped_prompts`` (left out of this epoch)."""
        if self._record_index is None:
            self._record_index = {id(r): i for i, r in enumerate(self.train_records)}
        k = self.prompt_repeat_k
        pairs = torch.tensor([[self._record_index[id(r)], all(x >= self.eval_pass_threshold
                                                                for x in rewards[g * k:(g + 1) * k])]
                              for g, r in enumerate(records)], dtype=torch.long).reshape(-1, 2)
        # every rank's groups (equal shares of the batch: rank_share), so all samplers leave out the same prompts
        for index, solved in all_gather(pairs).tolist():
            self.sampler.record(index, bool(solved))
        return {"data/solved_prompts": float(len(self.sampler.solved)),
                "data/skipped_prompts": float(len(self.sampler.left_out(self.sampler.epoch)))}

    def rollout_backend(self, records: list[PromptRecord]) -> RolloutBackend:
        """The backend that generates ``records``: the configured one, or its multi-turn view."""
        if self.multiturn is None:
            return self.split if self.split is not None else self.backend
        return RecordsRollout(self.multiturn, self.backend, records)

    def rank_share(self, batch: list[PromptRecord]) -> list[PromptRecord]:
        """This rank's prompts of a global batch: a contiguous slice, so a group never spans two ranks."""
        per = len(batch) // self.world_size
        return batch[self.rank * per: (self.rank + 1) * per]

    def regenerate(self, indices: list[int], generator: torch.Generator) -> Groups:
        """Generate and judge the training prompts at ``indices`` (dynamic sampling's extra rounds)."""
        records = [self.train_records[i] for i in indices]
        k = self.prompt_repeat_k
        groups = self.rollout_backend(records).generate(self.rollout_prompts(records), self.sampling, n=k)
        completions = [c for group in groups for c in group]
        result, texts = self.judges.judge(records, completions, k)
        return Groups(records, completions, result.rewards, texts, result.failed)

    def any_rank_short(self, short: bool) -> bool:
        """Whether any rank's dynamic-sampling batch is still short (every rank must run the same rounds)."""
        if self.world_size == 1:
            return short
        strategy = self.trainer.strategy
        return bool(strategy.reduce(torch.tensor(float(short), device=strategy.root_device), reduce_op="sum"))

    def sample_rows(self, step: int, records: list[PromptRecord], texts: list[str],
                    experiences: list[Experience]) -> list[dict]:
        """One dict per sample of a rollout step (trajectories.jsonl's rows; also the W&B samples table's)."""
        k = self.prompt_repeat_k
        return [{
            "step": step, "rank": self.rank, "group": e.group, "data_source": records[i // k].data_source,
            "prompt": self.prompt_text(records[i // k], e), "completion": text,
            "ground_truth": records[i // k].columns.get("ground_truth"),
            "reward": e.reward, "advantage": e.advantage, "finish_reason": e.finish_reason,
            "num_tokens": len(e.completion_ids), "policy_version": e.policy_version,
            **({"token_versions": e.token_versions} if e.token_versions is not None else {}),
            **({"judgers_failed": e.info["judgers_failed"]} if e.info.get("judgers_failed") else {}),
        } for i, (text, e) in enumerate(zip(texts, experiences))]

    def prompt_text(self, record: PromptRecord, experience: Experience) -> str:
        """The prompt a sample was generated from: the record's, or the one its environment wrote (decoded)."""
        if experience.prompt_ids is record.prompt_ids or experience.prompt_ids == record.prompt_ids:
            return record.prompt_text
        return self.tokenizer.decode(experience.prompt_ids, skip_special_tokens=False)

    def evaluate(self, batch: list[PromptRecord], step: int, batch_idx: int) -> dict[str, Any]:
        """Generate ``eval_k`` completions per prompt with the evaluation sampling settings and judge them.

        Sampling runs on a forked RNG seeded from (``seed``, ``step``, ``batch_idx``) (see
        :func:`rlflow.training.evaluation.isolated_rng`), so it never moves the training random stream. Returns per
        prompt
        lists of ``eval_k`` rewards, correctness flags, lengths, judger-failure flags and stated answers (None where
        no judger states them), the prompts' data sources, and ``samples``: one plain row per
        sample (``eval_trajectories.jsonl``'s, with ``trained_steps`` = ``step``, the rollout steps trained so far).
        """
        assert self.backend is not None, "bind() the policy first"
        k = self.eval_k
        seed = eval_seed(self.seed, step, batch_idx)
        with isolated_rng(seed), isolated_draws(self.backend, seed), self.all_cores():  # a seeded engine's draws too
            groups = self.rollout_backend(batch).generate(self.rollout_prompts(batch), self.eval_sampling, n=k)
        completions = [c for group in groups for c in group]
        result, texts = self.judges.judge(batch, completions, k)
        per_prompt = [result.rewards[i * k: (i + 1) * k] for i in range(len(batch))]
        correct = [[r >= self.eval_pass_threshold for r in group] for group in per_prompt]
        answers = self.judges.answers(batch, texts, k)  # for maj@k, and the rows' ``answer``
        samples = [{
            "trained_steps": step, "rank": self.rank, "batch": batch_idx, "data_source": batch[i // k].data_source,
            "prompt": batch[i // k].prompt_text, "sample": i % k, "completion": text,
            "ground_truth": batch[i // k].columns.get("ground_truth"), "reward": result.rewards[i],
            "correct": correct[i // k][i % k], "finish_reason": c.finish_reason,
            "num_tokens": c.num_sampled,
            **({"answer": answers[i // k][i % k]} if answers[i // k] is not None else {}),
            **({"judgers_failed": list(result.failed_at(i))} if result.failed_at(i) else {}),
        } for i, (text, c) in enumerate(zip(texts, completions))]
        return {
            "answers": answers,
            "rewards": per_prompt,
            "correct": correct,
            "lengths": [[c.num_sampled for c in g] for g in groups],
            "failed": [[bool(result.failed_at(i * k + j)) for j in range(k)] for i in range(len(batch))],
            "data_sources": [r.data_source for r in batch],
            "samples": samples,
        }

    # -------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The replay buffer, as plain types (``torch.load(weights_only=True)`` reads it); the sampler's position
        is saved by Lightning through :class:`PromptLoader`."""
        buffer = self.buffer.state_dict()
        state = {"buffer": {**buffer, "items": [dataclasses.asdict(e) for e in buffer["items"]]}}
        if self.pipeline is not None:
            state["pipeline"] = self.pipeline.state_dict()
        rollout_rng = self.backend.rng_state() if hasattr(self.backend, "rng_state") else self._rollout_rng
        if rollout_rng is not None:  # a seeded engine's draws (rlflow.rollout.draws)
            state["rollout_rng"] = rollout_rng
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("buffer") is not None:
            buffer = state["buffer"]
            self.buffer.load_state_dict({**buffer, "items": [Experience(**e) for e in buffer["items"]]})
        if self.pipeline is not None and state.get("pipeline") is not None:
            self.pipeline.load_state_dict(state["pipeline"], self.rank)
        self._rollout_rng = state.get("rollout_rng")
        if self._rollout_rng is not None and hasattr(self.backend, "load_rng_state"):
            self.backend.load_rng_state(self._rollout_rng)  # else when bind() builds the backend

    def teardown(self, stage: str) -> None:
        if self.pipeline is not None and stage == "fit":
            self.pipeline.close()  # the generator process
        if stage == "fit":
            for split in (self.split, self._split_generator):
                if split is not None:
                    split.close()
            self.split = self._split_generator = None
