"""``RolloutDataModule``: prompts in, judged experience out, as a composition of named parts.

The datamodule keeps the prompts, their sampler and the loaders, and wires the parts of experience making
together when the policy is bound (:meth:`RolloutDataModule.bind`):

* prompts: :class:`~rlflow.data.prompts.PromptSet` per split (sources read, rendered, tokenized, filtered) and
  its seeded batch sampler (:mod:`rlflow.data.sampler`, :mod:`rlflow.data.mix`);
* generation: the rollout backend (:class:`~rlflow.rollout.base.RolloutBackend`, the ``rlflow.rollout`` group),
  shared with a generator process by :class:`~rlflow.rollout.split.SplitRollout` or run ahead by
  :class:`~rlflow.rollout.pipeline.RolloutPipeline` (``data.pipeline``); multi-turn rollouts
  (``data.multiturn``) drive it turn by turn (:mod:`rlflow.rollout.multiturn`);
* rewards: the :class:`~rlflow.judgers.panel.JudgePanel` (``data.judging``);
* advantages: the estimator (the ``rlflow.advantages`` group) over every rank's batch;
* :class:`~rlflow.data.dynamic_sampling.DynamicSampling` (``data.filtering``) and the
  :class:`~rlflow.data.replay_buffer.ReplayBuffer`.

:class:`~rlflow.data.experience_maker.ExperienceMaker` is given these parts explicitly and runs one rollout step.

The train dataloader yields *prompt batches* only, which are cheap, so Lightning's one-batch prefetch costs
nothing and cannot make training off-policy: the expensive part, :meth:`RolloutDataModule.make_experience`, is
called by :class:`rlflow.training.module.GRPOModule` inside ``training_step``, after the previous optimizer step,
with the live policy, through the :class:`~rlflow.data.protocol.ExperienceSource` interface. Every experience is
stamped with the policy version that sampled it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from rlflow import registry
from rlflow.advantages.base import AdvantageEstimator
from rlflow.config_checks import check_data_args, check_multiturn_images, check_rank_share
from rlflow.config_error import ConfigError
from rlflow.data.dataset import PromptRecord
from rlflow.data.dynamic_sampling import DynamicSampling
from rlflow.data.experience import Experience, RolloutStep
from rlflow.data.experience_maker import EvalPlan, ExperienceMaker, Ranks
from rlflow.data.mix import MixBatchSampler
from rlflow.data.prompts import PromptSet, shared_prompts
from rlflow.data.replay_buffer import ReplayBuffer
from rlflow.data.sampler import PromptBatchSampler, PromptLoader
from rlflow.data.settings import (
    EvalSettings,
    FilteringSettings,
    JudgingSettings,
    MultiTurnSettings,
    PipelineSettings,
    PromptSettings,
)
from rlflow.data.sources import parse_sources
from rlflow.judgers.panel import JudgePanel
from rlflow.log import info, warn
from rlflow.models.vision import ImageInputs, any_images, check_backend_accepts_images, load_processor
from rlflow.rollout import prestart
from rlflow.rollout.base import RolloutBackend, SamplingParams, SamplingSettings, pad_with_eos, stop_token_ids
from rlflow.rollout.multiturn import MultiTurn
from rlflow.rollout.pipeline import make_pipeline, worker_spec
from rlflow.rollout.process import GeneratorProcess
from rlflow.rollout.select import resolve_backend
from rlflow.rollout.split import SplitRollout, split_problem
from rlflow.training.distributed import is_sharded


def _keep_records(batch: list[PromptRecord]) -> list[PromptRecord]:
    return list(batch)



#: A value of a data source mapping (``{path, weight, system_prompt, prompt_template, judgers, ...}``). Typed, not
#: ``Any``: the config parser reads an ``Any`` string as YAML, which turned ``prompt_template: 'Question: {prompt}'``
#: into a mapping.
SourceValue = str | int | float | bool | dict | list | None


def multiturn_parts(multiturn: MultiTurnSettings, chat_template_kwargs: dict[str, Any] | None
                    ) -> tuple[list[Any], dict[str, Any]]:
    """``data.multiturn``'s tools (loaded) and the arguments of its :class:`MultiTurn` (built with the tokenizer).
    The prompts are rendered with the tools' schemas, as the multi-turn messages are: the returned
    ``chat_template_kwargs`` carry them."""
    from rlflow.environments.trl_factory import EnvironmentFactory
    from rlflow.rollout.multiturn import tool_schemas
    from rlflow.tools.base import load_tools

    tools = load_tools(multiturn.tools)
    factory = None if multiturn.environment_factory is None else EnvironmentFactory(multiturn.environment_factory,
                                                                                     tools)
    schemas = tool_schemas(tools, factory)
    if schemas:
        chat_template_kwargs = {**(chat_template_kwargs or {}), "tools": schemas}
    return tools, dict(parser=multiturn.parser, environment=multiturn.environment, max_turns=multiturn.max_turns,
                       tool_timeout=multiturn.tool_timeout, tool_isolation=multiturn.tool_isolation,
                       max_tool_output=multiturn.max_tool_output, chat_template_kwargs=chat_template_kwargs,
                       environment_factory=factory)


def split_rollout_setting(pipelining: PipelineSettings, multiturn: bool) -> bool:
    """``data.pipeline.split_rollout`` as this run can use it: off, with the reason logged, where the generator
    process generates ahead (``max_staleness``) or rollouts are multi-turn."""
    if not pipelining.split_rollout or not (pipelining.max_staleness or multiturn):
        return pipelining.split_rollout
    why = f"data.pipeline.max_staleness={pipelining.max_staleness}: the generator process generates ahead instead" \
        if pipelining.max_staleness else "multi-turn rollouts (data.multiturn) are not split"
    info(f"data.pipeline.split_rollout is off for this run: {why}")
    return False


class RolloutDataModule(L.LightningDataModule):
    """Wraps the prompt sets and, through its :class:`~rlflow.data.experience_maker.ExperienceMaker`, the rollout
    backend, the judge panel, the advantage estimator and the replay buffer."""

    def __init__(  # size: 50 of its lines are the documented settings (signature and docstring)
        self,
        train_data_path: str | dict[str, SourceValue] | list[str | dict[str, SourceValue]],
        eval_data_path: str | dict[str, SourceValue] | list[str | dict[str, SourceValue]] | None = None,
        tokenizer_path: str | None = None,
        prompt_repeat_k: int = 8,
        global_batch_size: int = 16,
        max_prompt_length: int = 512,
        seed: int = 0,
        rollout: str | RolloutBackend = "auto",
        advantage: str | AdvantageEstimator = "grpo",
        sampling: SamplingSettings = SamplingSettings(),  # noqa: B008 (a frozen default: groups are copied)
        judging: JudgingSettings = JudgingSettings(),  # noqa: B008
        eval: EvalSettings = EvalSettings(),  # noqa: B008
        prompts: PromptSettings = PromptSettings(),  # noqa: B008
        filtering: FilteringSettings = FilteringSettings(),  # noqa: B008
        pipeline: PipelineSettings = PipelineSettings(),  # noqa: B008
        multiturn: MultiTurnSettings = MultiTurnSettings(),  # noqa: B008
    ) -> None:
        """
        Args:
            train_data_path: Training prompts in XTuner's RL format or TRL's layout: a jsonl/JSON/parquet file, a glob,
                a directory of shards, a ``datasets.save_to_disk`` dir (``dir?split=train`` for one split of a
                ``DatasetDict``) or a hub dataset in the local ``datasets`` cache,
                ``hf://OWNER/NAME?config=CONFIG&split=SPLIT`` (read as ``load_dataset`` reads it, never downloaded; a
                local path that exists wins); or a list of sources, each a path or a mapping
                ``{path, weight, max_prompt_length, judgers, name, system_prompt, prompt_template}`` (``weight``: the
                source's share of every batch). See :class:`rlflow.data.sources.DataSource`.
            eval_data_path: Evaluation prompts, given the same way; None disables evaluation.
            tokenizer_path: Tokenizer to load; linked to ``model.model_path`` by the CLI.
            prompt_repeat_k: Completions sampled per prompt (the GRPO group size, at least 2).
            global_batch_size: Prompts per rollout step, over all ranks.
            max_prompt_length: Prompts longer than this many tokens are dropped (and counted), never truncated.
            seed: Seed of the prompt order (each epoch uses ``seed + epoch``), of the replay buffer's shuffles and of
                pipelined and evaluation sampling.
            rollout: Rollout backend: ``auto`` (the default: the ``engine`` backend where it can run the model,
                else ``hf``, with the reason logged; see :mod:`rlflow.rollout.select`), a short name of the
                ``rlflow.rollout`` group, an import path or ``class_path``/``init_args`` (``--data.rollout.help
                engine`` lists its options). A backend named explicitly that cannot run the model is an error.
            advantage: Advantage estimator: a short name of the ``rlflow.advantages`` group, an import path or
                ``class_path``/``init_args`` (``--data.advantage.help grpo`` lists its options).
            sampling: How training rollouts sample completions.
            judging: Which judgers score each data source, and how their rewards combine.
            eval: How evaluation prompts are sampled and scored.
            prompts: How dataset rows become prompts.
            filtering: Which groups and prompts are worth training on (dynamic sampling, solved prompts).
            pipeline: Where and when rollouts are generated (pipelined, split across processes).
            multiturn: Tool calls and environments (multi-turn rollouts).
        """
        super().__init__()
        check_data_args(locals())  # every invalid value is one ConfigError naming its option
        self.sampling_settings = sampling = SamplingSettings.coerce(sampling)
        self.judging = judging = JudgingSettings.coerce(judging)
        self.eval_settings = eval_ = EvalSettings.coerce(eval)
        prompts = PromptSettings.coerce(prompts)
        self.filtering = filtering = FilteringSettings.coerce(filtering)
        self.pipeline_settings = pipelining = PipelineSettings.coerce(pipeline)
        multiturn = MultiTurnSettings.coerce(multiturn)
        train_sources = parse_sources(train_data_path, "data.train_data_path")
        if not train_sources:
            raise ConfigError("data.train_data_path is empty")
        eval_sources = parse_sources(eval_data_path, "data.eval_data_path")
        self.tools, self.multiturn_args = multiturn_parts(multiturn, prompts.chat_template_kwargs)
        chat_template_kwargs = self.multiturn_args["chat_template_kwargs"]
        self.multiturn: MultiTurn | None = None  # built with the tokenizer
        if multiturn.enabled:  # a wrong parser/environment/max_turns fails before any model loads
            MultiTurn(None, self.tools, **self.multiturn_args)
        formats = dict(system_prompt=prompts.system_prompt, prompt_template=prompts.template,
                       chat_template_kwargs=chat_template_kwargs)
        # the parts, built here so that a wrong plugin name or setting fails before any model is loaded
        self.train_prompts = PromptSet(train_sources, "train", max_prompt_length, **formats)
        self.eval_prompts = PromptSet(eval_sources, "eval", max_prompt_length, **formats)
        self.sampling = sampling.params()  # the stop token ids follow with the tokenizer
        self.eval_sampling = SamplingParams(eval_.temperature, 1.0, 0, sampling.max_tokens)
        self.judges = JudgePanel(judging.judger_specs(), judging.weights, [*train_sources, *eval_sources],
                                 timeout=judging.timeout, max_tokens=sampling.max_tokens,
                                 max_failure_rate=judging.max_failure_rate, isolation=judging.isolation)
        self.advantage = registry.build("rlflow.advantages", advantage)
        dynamic = DynamicSampling(filtering.max_rounds, seed)  # validated even when off
        self.dynamic_sampling = dynamic if filtering.dynamic_sampling else None
        if self.dynamic_sampling is not None and getattr(self.advantage, "needs_components", False):
            raise ConfigError("data.advantage=gdpo normalises each judger's rewards apart; data.filtering."
                              "dynamic_sampling filters groups by their summed reward: use one or the other")
        self.buffer = ReplayBuffer(seed=seed)
        self.rollout_spec = rollout
        self.backend: RolloutBackend | None = None
        self.maker: ExperienceMaker | None = None  # built when the policy is bound
        self._rollout_rng: dict[str, Any] | None = None  # a checkpoint's engine draw state, until bind() applies it
        self.sampler: PromptBatchSampler | MixBatchSampler | None = None
        self.rollout_progress: Any = None  # a listener with start(total), update(completions, tokens), close()
        self.tokenizer: Any = None
        self.processor: Any = None  # a vision-language model's processor (rlflow.models.vision); None for text-only
        self.image_inputs: ImageInputs | None = None
        self.tokenizer_path = tokenizer_path
        self.stop = list(sampling.stop or [])
        self.prompt_repeat_k = prompt_repeat_k
        self.global_batch_size = global_batch_size
        self.eval_batch_size = eval_.batch_size
        self.eval_k = eval_.k
        self.eval_pass_threshold = eval_.pass_threshold  # also train/accuracy's bar (rlflow.training.callbacks)
        self.seed = seed
        self.max_staleness = pipelining.max_staleness
        split_rollout = split_rollout_setting(pipelining, multiturn.enabled)
        self.split_rollout, self.generator_threads = split_rollout, pipelining.generator_threads
        self.split: SplitRollout | None = None  # data.pipeline.split_rollout: the backend of fit's rollouts (bind)
        self._split_generator: GeneratorProcess | None = None  # started in setup("fit"), attached in bind
        self.pipeline = make_pipeline(pipelining, seed, filtering.dynamic_sampling, multiturn=multiturn.enabled)

    # ----------------------------------------------------------------------------------------------- set-up
    def load_tokenizer(self) -> Any:
        """The policy's tokenizer (loaded once); its EOS and ``data.sampling.stop`` become the stop tokens."""
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
            if self.tools or any(self.multiturn_args[key] is not None for key in ("environment",
                                                                                  "environment_factory")):
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
        """Why ``data.pipeline.split_rollout`` cannot run here (:func:`rlflow.rollout.split.split_problem`), None if
        it can."""
        strategy = self.trainer.strategy if self.trainer is not None else None
        return split_problem(self.generator_threads, self.world_size, strategy is not None and is_sharded(strategy),
                             strategy.root_device.type if strategy is not None else "cpu", backend)

    def setup(self, stage: str) -> None:
        # data.pipeline.split_rollout: its generator process starts now, unless the run's settings already rule
        # the split out (bind() says why, with the backend known)
        split = stage == "fit" and self.split_rollout and self.split_problem() is None
        if self.pipeline is None and not split:
            prestart.discard()  # `rlflow fit` predicted a run with a generator process; it is not one
        if split and self._split_generator is None and self.split is None:
            self._split_generator = GeneratorProcess(self.generator_threads, tokenizer_path=self.tokenizer_path)
        if stage == "fit" and self.sampler is None and self.pipeline is not None:
            # data.pipeline.max_staleness > 0: the generator process starts first, so that its imports and tokenizer
            # overlap everything the trainer loads before the first step
            self.pipeline.prestart(self.tokenizer_path)
        tokenizer = self.load_tokenizer()
        if stage == "fit" and self.sampler is None:
            self.judges.check_rows(self.train_prompts.load(tokenizer, self.processor), "train")
            check_rank_share(self.global_batch_size, self.world_size)  # `rlflow fit` checked it before starting
            self.sampler = self.train_prompts.sampler(self.global_batch_size, self.seed, self.filtering.skip_solved)
        if stage in ("fit", "validate") and self.eval_prompts.sources and not self.eval_records:
            self.judges.check_rows(self.eval_prompts.load(tokenizer, self.processor), "eval")
            shared = shared_prompts(self.train_prompts.records, self.eval_records)
            if shared:  # eval/accuracy counts prompts the policy trains on: a warning unless it is the whole set
                say = info if len(shared) == len(self.eval_records) else warn  # (evaluating on trained prompts)
                say(f"data: {len(shared)} of {len(self.eval_records)} eval prompts are also train prompts (the first: "
                    f"{shared[0].source}); eval/accuracy is not held-out accuracy on them")

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
    def bind(self, policy: torch.nn.Module, current_version: Callable[[], int] | None = None) -> RolloutBackend:
        """Build the rollout backend (once; ``auto`` chooses it for ``policy``), point it at the live policy, and
        build the experience maker from the parts. ``current_version()`` is the trainer's policy version now."""
        if self.backend is None:
            self.backend = resolve_backend(self.rollout_spec, policy, self.load_tokenizer())
            if self._rollout_rng is not None and hasattr(self.backend, "load_rng_state"):
                self.backend.load_rng_state(self._rollout_rng)  # a resumed run: continue a seeded engine's draws
            check_backend_accepts_images(self.backend, self.train_records + self.eval_records)
            check_multiturn_images(any_images(self.train_records + self.eval_records), self.multiturn is not None)
            if self.pipeline is not None and any_images(self.train_records):
                raise ConfigError(f"prompts with images are not pipelined: set data.pipeline.max_staleness=0 (got "
                                  f"{self.max_staleness})")
        else:
            self.backend.bind(policy, self.load_tokenizer())
        fitting = self.trainer is not None and self.trainer.state.fn == "fit"
        if self.pipeline is not None and fitting:  # the generator starts up alongside the trainer
            self.pipeline.start(self.backend, self.tokenizer_path, worker_spec(self.rollout_spec, self.backend),
                                self.world_size, current_version)
        if self.split_rollout and self.split is None and fitting:
            self.start_split()
        self.maker = ExperienceMaker(
            backend=self.backend, judges=self.judges, advantage=self.advantage, buffer=self.buffer,
            sampling=self.sampling, k=self.prompt_repeat_k, prompts=self.train_prompts, sampler=self.sampler,
            ranks=Ranks(self.rank, self.world_size, self.any_rank_short), tokenizer=self.tokenizer,
            evaluation=EvalPlan(self.eval_sampling, self.eval_k, self.eval_settings.pass_threshold, self.seed),
            pipeline=self.pipeline, split=self.split, multiturn=self.multiturn,
            dynamic_sampling=self.dynamic_sampling, image_inputs=self.image_inputs,
            overlap_judging=self.judging.overlap, skip_solved=self.filtering.skip_solved,
            max_steps=self.trainer.max_steps if self.trainer is not None else -1,
            max_epochs=self.trainer.max_epochs if self.trainer is not None else None)
        return self.backend

    def start_split(self) -> None:
        """``data.pipeline.split_rollout``: hand the generator process started in ``setup`` half of each rollout,
        or say in one line why this run cannot split."""
        problem = self.split_problem(self.backend)
        if problem:
            info(f"data.pipeline.split_rollout is off for this run: {problem}")
            self.split_rollout = False
            if self._split_generator is not None:
                self._split_generator.close()
                self._split_generator = None
            return
        self.split = SplitRollout(self.backend, self.generator_threads, self._split_generator)
        self._split_generator = None
        self.split.attach(self.tokenizer_path, worker_spec(self.rollout_spec, self.backend))
        info(f"data.pipeline.split_rollout: the generator process decodes half of each rollout's prompts on "
             f"{self.generator_threads} torch thread(s), the trainer the other half on {self.split.local_threads}")

    @property
    def reads_policy_weights(self) -> bool:
        return self.backend is None or self.backend.reads_policy_weights

    def sync_weights(self) -> None:
        """After every optimizer step: the trainer's backend (and a split rollout's, the same engine) drops what it
        kept of the old weights, pipelined or not, since evaluation and the pipeline's generations in this process
        run on it. A pipelined run's generator process still gets the weights between its jobs
        (:meth:`RolloutPipeline.sync_weights <rlflow.rollout.pipeline.RolloutPipeline.sync_weights>`)."""
        if self.pipeline is not None:
            self.pipeline.sync_weights()
        elif self.backend is not None:
            self.backend.sync_weights()

    def minibatches(self, num: int) -> list[list[Experience]]:
        return self.buffer.drain(num)

    def make_experience(self, batch: list[PromptRecord], policy_version: int, step: int) -> RolloutStep:
        """Generate, judge and score one rollout step; put the experience in the replay buffer."""
        assert self.maker is not None, "bind() the policy first"
        if self.sampler is not None:
            self.sampler.mark_consumed()  # its checkpointed position follows trained batches, not prefetched ones
        return self.maker.make(batch, policy_version, step, self.rollout_progress)

    def evaluate(self, batch: list[PromptRecord], step: int, batch_idx: int) -> dict[str, Any]:
        """Generate and judge one evaluation batch (:meth:`ExperienceMaker.evaluate`)."""
        assert self.maker is not None, "bind() the policy first"
        if self.pipeline is not None:
            self.pipeline.weights_for_evaluation()
        return self.maker.evaluate(batch, step, batch_idx, self.all_cores())

    def any_rank_short(self, short: bool) -> bool:
        """Whether any rank's dynamic-sampling batch is still short (every rank must run the same rounds)."""
        if self.world_size == 1:
            return short
        strategy = self.trainer.strategy
        return bool(strategy.reduce(torch.tensor(float(short), device=strategy.root_device), reduce_op="sum"))

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

    def on_exception(self, exception: BaseException) -> None:
        """A fit that fails, is refused or is interrupted (Lightning calls this, not :meth:`teardown`) stops its
        generator processes now, not at the interpreter's exit, and takes back the torch threads it lent them: a
        Python-API caller keeps no idle process per failed run. A job in flight gets a second to end (its
        completions, if a checkpoint needed them, are in it), as at the interpreter's exit."""
        from rlflow.rollout.process import GeneratorProcess

        if self.pipeline is not None and isinstance(self.pipeline.generator, GeneratorProcess):
            self.pipeline.close(wait=1.0, keep=False)  # a server's thread (lmdeploy) ends with its backend
        for split in (self.split, self._split_generator):  # a SplitRollout, or the process it has not taken yet
            if split is not None:
                split.close(wait=1.0, keep=False)

    def teardown(self, stage: str) -> None:
        if self.pipeline is not None and stage == "fit":
            self.pipeline.close()  # the generator process
        if stage == "fit":
            for split in (self.split, self._split_generator):
                if split is not None:
                    split.close()
            self.split = self._split_generator = None
            self.judges.close()  # user judgers' and tools' idle worker processes end with the run
            if self.multiturn is not None:
                self.multiturn.runner.close()
            if self.maker is not None:
                self.maker.single_turn = self.backend  # later evaluations run on the trainer's backend
