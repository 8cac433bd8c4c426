"""Every field a TRL GRPO config may hold, with its rlflow key or why it has none: the one table behind
``rlflow config from-trl`` and the field tables of the guide's "Coming from TRL" page.

The fields are those of TRL's ``GRPOConfig`` (with transformers' ``TrainingArguments``), of the ``trl grpo``
script's ``GRPOScriptArguments`` (the dataset, ``reward_funcs``), ``ModelConfig`` (the model, LoRA) and
``DatasetMixtureConfig``, plus a few fields of older TRL and transformers versions (``OLDER``). Each
:class:`Field` carries TRL's default, the rlflow keys its value becomes, the note the page shows (what differs,
or why there is no key) and its conversion (:mod:`rlflow.trl_config.converters`); a field without one is never
converted, and the note is the reason given when a file sets it to a value other than its default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlflow.trl_config import converters as c

#: The topics of the page's tables, in its order.
TOPICS = (
    "Model and reference model", "Dataset and prompts", "Batches and steps", "Generation", "Loss",
    "Rewards and advantages", "Optimizer and learning rate", "The run: length, seeds, checkpoints, output",
    "Logging", "Evaluation", "Generation back-ends and rollout correction", "Precision, memory and kernels",
    "Processes, data loading and distributed training", "The Hugging Face Hub",
)
MODEL, DATA, BATCH, GENERATION, LOSS, REWARDS, OPTIM, RUN, LOGGING, EVAL, BACKENDS, HARDWARE, DISTRIBUTED, HUB = TOPICS


@dataclass(frozen=True)
class Field:
    """One TRL field: its topic on the page, the rlflow keys its value becomes (none: no counterpart), the note
    (what differs, or why there is no key), its conversion (None: never converted), TRL's default and the type
    its value is read as (None: as given; default: the default's type)."""

    topic: str
    keys: tuple[str, ...]
    note: str
    convert: c.Convert | None = None
    default: Any = None
    kind: type | None = None

    @property
    def value_type(self) -> type | None:
        """The type a given value is read as."""
        if self.kind is not None or self.default is None:
            return self.kind
        return type(self.default) if type(self.default) in (bool, int, float, str) else None


def mapped(topic: str, keys: str | tuple[str, ...], default: Any, convert: c.Convert | None = None, note: str = "",
           kind: type | None = None) -> Field:
    """A field with an rlflow counterpart; by default its value goes to its one key as it is."""
    keys = (keys,) if isinstance(keys, str) else keys
    return Field(topic, keys, note, convert or c.to(keys[0]), default, kind)


def explained(topic: str, note: str, **defaults: Any) -> dict[str, Field]:
    """Fields without a counterpart, sharing one explanation; ``defaults``: each field's TRL default."""
    return {name: Field(topic, (), note, None, default) for name, default in defaults.items()}


L = c.LOSS
EVAL_KEYS = ("data.eval_data_path", "evaluate_every_n_steps", "data.eval.k", "data.eval.temperature",
             "data.eval.batch_size")
CHECKPOINT_KEYS = ("checkpoint.every_n_train_steps", "checkpoint.every_n_epochs", "checkpoint.save_top_k",
                   "checkpoint.save_weights_only", "trainer.enable_checkpointing")
BATCH_KEYS = ("data.global_batch_size", "model.update.optimizer_steps")
LORA_ONLY = "with `use_peft` only"
JUDGERS = c.only(c.judgers, "data.judging.judgers")

MODEL_FIELDS: dict[str, Field] = {
    "model_name_or_path": mapped(MODEL, "model.model_path", None, kind=str),
    **explained(MODEL, "rlflow loads a directory or the hub's default revision: download the revision "
                "(`huggingface-cli download ID --revision R --local-dir DIR`) and name the directory",
                model_revision="main"),
    "dtype": mapped(MODEL, "model.policy.dtype", "float32", c.policy_dtype,
                    "`float32`, `bfloat16` or `float16`; `auto` has none (rlflow's dtype is explicit)"),
    "attn_implementation": mapped(MODEL, "model.policy.attn_implementation", None, kind=str),
    "model_init_kwargs": mapped(MODEL, ("model.policy.dtype", "model.policy.attn_implementation"), None,
                                c.model_init_kwargs, "its `dtype` (or `torch_dtype`) and `attn_implementation`; "
                                "other keys have none (rlflow loads the model itself)", kind=dict),
    **explained(MODEL, "rlflow runs the architectures transformers ships, never a model's own code",
                trust_remote_code=False),
    "router_aux_loss_coef": mapped(MODEL, "model.policy.router_aux_loss_coef", None, kind=float),
    "disable_dropout": mapped(MODEL, "model.policy.disable_dropout", False, note="on by default in rlflow, off in TRL"),
    "cast_lm_head_to_fp32": mapped(MODEL, "model.policy.cast_lm_head_to_fp32", False,
                                   note="also in the engine's decode"),
    "gradient_checkpointing": mapped(MODEL, "model.policy.gradient_checkpointing", True,
                                     note="on by default in TRL, off in rlflow"),
    **explained(MODEL, "rlflow turns the model's gradient checkpointing on itself "
                "(`model.policy.gradient_checkpointing`)", gradient_checkpointing_kwargs=None,
                activation_checkpointing=None, activation_checkpointing_kwargs=None),
    "sync_ref_model": mapped(MODEL, "model.reference.sync_steps", False, c.reference_sync,
                             "`ref_model_sync_steps` in rollout steps where set; unset, a fixed reference"),
    "ref_model_sync_steps": mapped(MODEL, "model.reference.sync_steps", 512, c.reference_sync,
                                   "optimizer steps in TRL, rollout steps in rlflow: converted"),
    "ref_model_mixup_alpha": mapped(MODEL, "model.reference.mixup_alpha", 0.6, c.reference_mixup),
    "use_peft": mapped(MODEL, "model.lora", False, lambda value, run: {},
                       "set: `model.lora`, with the options below"),
    "lora_r": mapped(MODEL, "model.lora.r", 16, c.lora("model.lora.r"), LORA_ONLY),
    "lora_alpha": mapped(MODEL, "model.lora.alpha", 32, c.lora("model.lora.alpha"), LORA_ONLY),
    "lora_dropout": mapped(MODEL, "model.lora.dropout", 0.05, c.lora("model.lora.dropout"), LORA_ONLY),
    "lora_target_modules": mapped(MODEL, "model.lora.target_modules", None, c.lora_target_modules,
                                  "unset, PEFT's default modules of the architecture; rlflow's default is "
                                  "`all-linear`", kind=list),
    "lora_target_parameters": mapped(MODEL, "model.lora.options.target_parameters", None,
                                     c.lora_option("model.lora.options.target_parameters"), LORA_ONLY, kind=list),
    "lora_modules_to_save": mapped(MODEL, "model.lora.options.modules_to_save", None,
                                   c.lora_option("model.lora.options.modules_to_save"), LORA_ONLY, kind=list),
    "use_rslora": mapped(MODEL, "model.lora.options.use_rslora", False, c.lora_option("model.lora.options.use_rslora"),
                         LORA_ONLY),
    "use_dora": mapped(MODEL, "model.lora.options.use_dora", False, c.lora_option("model.lora.options.use_dora"),
                       LORA_ONLY),
    "lora_task_type": Field(MODEL, (), "rlflow's adapters are `CAUSAL_LM`'s", c.lora_task_type, "CAUSAL_LM"),
    **explained(MODEL, "rlflow has no bitsandbytes quantization: it trains float32 or bfloat16 weights "
                "(`model.policy.dtype`), or LoRA adapters (`model.lora`)", load_in_8bit=False, load_in_4bit=False,
                bnb_4bit_quant_type="nf4", use_bnb_nested_quant=False, bnb_4bit_quant_storage=None),
}

DATA_FIELDS: dict[str, Field] = {
    "dataset_name": mapped(DATA, "data.train_data_path", None, c.train_data,
                           "a local file or directory (its `dataset_train_split`: `train.jsonl`, `train-*.parquet`, a "
                           "`save_to_disk` split) or a hub id", kind=str),
    "dataset_config": mapped(DATA, "data.train_data_path", None, c.train_data, "a hub dataset's configuration",
                             kind=str),
    "dataset_train_split": mapped(DATA, "data.train_data_path", "train", c.train_data),
    "dataset_test_split": mapped(DATA, "data.eval_data_path", "test", c.only(c.evaluation, "data.eval_data_path"),
                                 "read where `eval_strategy` is not `no`"),
    **explained(DATA, "rlflow reads a source whole into prompt records (columnar files are streamed while read)",
                dataset_streaming=False, streaming=False),
    **explained(DATA, "a mixture: give `data.train_data_path` a list of sources, each with its `weight` (its share "
                "of every batch)", datasets=[]),
    **explained(DATA, "rlflow does not split a dataset: give the evaluation prompts as `data.eval_data_path`",
                test_split_size=None),
    **explained(DATA, "rlflow shuffles the prompts, seeded by `data.seed`", shuffle_dataset=True),
    **explained(DATA, "every column reaches the judgers", remove_unused_columns=False),
    "max_prompt_length": mapped(DATA, "data.max_prompt_length", None,
                                note="a field of older TRL versions; longer prompts are dropped and counted, not "
                                "truncated", kind=int),
    "chat_template_kwargs": mapped(DATA, "data.prompts.chat_template_kwargs", None, kind=dict),
}

BATCH_FIELDS: dict[str, Field] = {
    "num_generations": mapped(BATCH, ("data.prompt_repeat_k", "data.global_batch_size"), 8, c.group_size,
                              "`data.global_batch_size` counts prompts: TRL's generation batch (completions) / "
                              "`num_generations`", kind=int),
    "per_device_train_batch_size": mapped(BATCH, ("data.global_batch_size", "model.update.micro_batch_size"), 8,
                                          c.micro_batch, "TRL's generation batch is `per_device_train_batch_size` x "
                                          "processes x `steps_per_generation` completions; `micro_batch_size` is "
                                          "used only where packing falls back to padded micro-batches"),
    "gradient_accumulation_steps": mapped(BATCH, BATCH_KEYS, 1, c.update_steps,
                                          "`model.update.optimizer_steps` is `steps_per_generation` / "
                                          "`gradient_accumulation_steps`: optimizer steps per rollout step"),
    "steps_per_generation": mapped(BATCH, BATCH_KEYS, None, c.update_steps,
                                   "unset, `gradient_accumulation_steps` (one optimizer step per generation)",
                                   kind=int),
    "generation_batch_size": mapped(BATCH, BATCH_KEYS, None, c.update_steps, "completions", kind=int),
    "num_iterations": mapped(BATCH, "model.update.num_iterations", 1),
    **explained(BATCH, "TRL refuses it for GRPO", auto_find_batch_size=False),
    **explained(BATCH, "rlflow's loss normalisers count tokens over all ranks (`model.loss`'s `aggregation`)",
                average_tokens_across_devices=True),
}

GENERATION_FIELDS: dict[str, Field] = {
    "max_completion_length": mapped(GENERATION, "data.sampling.max_tokens", 512, kind=int),
    "temperature": mapped(GENERATION, "data.sampling.temperature", 1.0),
    "top_p": mapped(GENERATION, "data.sampling.top_p", 1.0),
    "top_k": mapped(GENERATION, "data.sampling.top_k", 0),
    "min_p": mapped(GENERATION, "data.sampling.min_p", None, kind=float),
    "repetition_penalty": mapped(GENERATION, "data.sampling.repetition_penalty", 1.0,
                                 note="the rollout log-probs include the penalty (vLLM's `processed_logprobs`, as TRL "
                                 "asks for)"),
    **explained(GENERATION, "free-form options of transformers' `GenerationConfig` or vLLM; rlflow's sampling options "
                "are `data.sampling`'s (`stop` for stop strings)", generation_kwargs=None),
    **explained(GENERATION, "rlflow's engine keeps its own KV cache", cache_implementation=None),
    "max_tool_calling_iterations": mapped(GENERATION, "data.multiturn.max_turns", None, c.max_turns,
                                          "`max_turns` counts the model's turns: iterations + 1; unset (no limit in "
                                          "TRL) keeps rlflow's 4", kind=int),
}

LOSS_FIELDS: dict[str, Field] = {
    "loss_type": mapped(LOSS, "model.loss.class_path", "dapo", c.loss_type,
                        "the same names: `grpo`, `bnpo`, `dr_grpo`, `dapo`, `cispo`, `sapo`, `luspo`, `vespo` (and "
                        "`gspo` in rlflow); TRL's default is `dapo`, rlflow's `bnpo`; TRL's `bnpo` averages over each "
                        "device's micro-batch, rlflow's over the optimizer step's mini-batch"),
    "epsilon": mapped(LOSS, L + "epsilon_low", 0.2),
    "epsilon_high": mapped(LOSS, L + "epsilon_high", None, c.epsilon_high,
                           "unset, `epsilon`; for `cispo` TRL's value is the cap, rlflow's cap is `1 + epsilon_high`: "
                           "converted", kind=float),
    "delta": mapped(LOSS, L + "delta", None, c.when(c.loss_is(*c.CLIPPED_LOSSES), c.to(L + "delta")),
                    "the clipped losses (TRL ignores it for `cispo`, `sapo` and `vespo`)", kind=float),
    "importance_sampling_level": mapped(LOSS, L + "importance_sampling_level", "token",
                                        note="`gspo` is `grpo` at the `sequence` level"),
    "beta": mapped(LOSS, L + "kl_coef", 0.0, note="rlflow's `kl_type` `k3` is TRL's estimator; 0 loads no "
                   "reference, as in TRL"),
    "use_bias_correction_kl": mapped(LOSS, L + "use_bias_correction_kl", True, c.kl_option("use_bias_correction_kl"),
                                     "on by default in TRL, off in rlflow"),
    "mask_truncated_completions": mapped(LOSS, L + "mask_truncated_completions", False),
    "top_entropy_quantile": mapped(LOSS, L + "top_entropy_quantile", 1.0,
                                   note="the quantile is taken per micro-batch on each rank"),
    "off_policy_mask_threshold": mapped(LOSS, L + "off_policy_mask_threshold", None, kind=float),
    "entropy_coef": mapped(LOSS, L + "entropy_coef", 0.0,
                           note="the bonus is normalised like the loss (TRL: always a token mean)"),
    "use_adaptive_entropy": mapped(LOSS, L + "use_adaptive_entropy", False),
    **{name: mapped(LOSS, L + name, default, c.adaptive_entropy(name), "with `use_adaptive_entropy` only")
       for name, default in (("entropy_target", 0.2), ("entropy_coef_min", 0.0), ("entropy_coef_max", 1.0),
                             ("entropy_coef_delta", 0.005))},
    **{trl: mapped(LOSS, L + ours, default, c.when(c.loss_is("sapo"), c.to(L + ours)), "`sapo`")
       for trl, ours, default in (("sapo_temperature_pos", "tau_pos", 1.0), ("sapo_temperature_neg", "tau_neg", 1.05))},
    **{f"vespo_{name}": mapped(LOSS, L + name, default, c.when(c.loss_is("vespo"), c.to(L + name)), "`vespo`")
       for name, default in (("k_pos", 2.0), ("lambda_pos", 3.0), ("k_neg", 3.0), ("lambda_neg", 2.0))},
    **explained(LOSS, "an option of supervised losses", label_smoothing_factor=0.0),
}

REWARD_FIELDS: dict[str, Field] = {
    "reward_funcs": mapped(REWARDS, "data.judging.judgers", None, JUDGERS,
                           "TRL's script's names (`accuracy_reward`, `reasoning_accuracy_reward`, "
                           "`think_format_reward`, `get_soft_overlong_punishment` with the script's values) and "
                           "dotted import paths, judging every data source (`*`); a reward function works unchanged "
                           "as a judger", kind=list),
    "reward_model_name_or_path": mapped(REWARDS, "data.judging.judgers", None, JUDGERS,
                                        "the `reward_model` judger, named after the model as in TRL", kind=str),
    "reward_weights": mapped(REWARDS, ("data.judging.weights", "data.judging.judgers"), None, c.judgers,
                             "by judger name, not by position: the judgers are named, TRL's own reward functions and "
                             "the reward model as TRL names them, a dotted path after its last part", kind=list),
    "scale_rewards": mapped(REWARDS, "data.advantage", "group", c.advantage,
                            "`data.advantage: {class_path: grpo, init_args: {scale_rewards: ...}}`; `true` and "
                            "`false` are `group` and `none`", kind=object),
    "multi_objective_aggregation": mapped(REWARDS, "data.advantage", "sum_then_normalize", c.advantage,
                                          "`normalize_then_sum` is `data.advantage: gdpo`"),
}

OPTIM_FIELDS: dict[str, Field] = {
    "learning_rate": mapped(OPTIM, "model.optim.lr", 1e-6),
    "lr_scheduler_type": mapped(OPTIM, "model.optim.lr_schedule", "linear", c.schedule,
                                "`linear`, `cosine`, `constant` and `constant_with_warmup` (`constant` after the "
                                "warm-up); TRL's default is `linear`, rlflow's `constant`"),
    **explained(OPTIM, "rlflow's schedules take no options", lr_scheduler_kwargs=None),
    "warmup_steps": mapped(OPTIM, "model.optim.warmup_steps", 0, c.warmup,
                           "optimizer steps in both; a fraction (< 1) of the run is converted where `max_steps` is "
                           "set; with `constant` (no warm-up in transformers) 0", kind=float),
    "warmup_ratio": mapped(OPTIM, "model.optim.warmup_steps", None, c.warmup,
                           "a field of older transformers versions; converted where `max_steps` is set", kind=float),
    "optim": mapped(OPTIM, "model.optim.optimizer", "adamw_torch_fused", c.optimizer,
                    "`adamw_torch` and `adamw_torch_fused` are `adamw`; for bf16 weights rlflow has `adamw_kahan` "
                    "and `adamw_bf16_sr`"),
    **explained(OPTIM, "options of transformers' other optimizers", optim_args=None, optim_target_modules=None),
    "weight_decay": mapped(OPTIM, "model.optim.weight_decay", 0.0),
    "adam_beta1": mapped(OPTIM, "model.optim.betas", 0.9, c.betas),
    "adam_beta2": mapped(OPTIM, "model.optim.betas", 0.999, c.betas),
    "adam_epsilon": Field(OPTIM, (), "rlflow's AdamW uses torch's `eps`, 1e-8, TRL's default", c.adam_epsilon, 1e-8),
    "max_grad_norm": mapped(OPTIM, "model.optim.max_grad_norm", 1.0, c.grad_norm, "0 disables clipping (`null`)"),
    **explained(OPTIM, "NEFTune's embedding noise, an option of supervised fine-tuning", neftune_noise_alpha=None),
}

RUN_FIELDS: dict[str, Field] = {
    "max_steps": mapped(RUN, ("trainer.max_steps", "trainer.max_epochs"), -1, c.run_length,
                        "rollout steps: `max_steps` / (`model.update.optimizer_steps` x "
                        "`model.update.num_iterations`), rounded up"),
    "num_train_epochs": mapped(RUN, ("trainer.max_epochs", "trainer.max_steps"), 3.0, c.run_length,
                               "whole epochs, where `max_steps` is not set"),
    "seed": mapped(RUN, ("seed_everything", "data.seed"), 42, c.seeds, "`data.seed` orders the prompts"),
    "data_seed": mapped(RUN, "data.seed", None, c.data_seed, kind=int),
    "full_determinism": mapped(RUN, "trainer.deterministic", False, c.flag("trainer.deterministic")),
    "output_dir": mapped(RUN, "trainer.default_root_dir", None, kind=str),
    "save_strategy": mapped(RUN, CHECKPOINT_KEYS, "steps", c.checkpoints,
                            "`no` turns checkpoints off, `epoch` saves once an epoch; `best` has none"),
    "save_steps": mapped(RUN, "checkpoint.every_n_train_steps", 500,
                         c.only(c.checkpoints, "checkpoint.every_n_train_steps"),
                         "optimizer steps in TRL, rollout steps in rlflow: converted", kind=float),
    "save_total_limit": mapped(RUN, "checkpoint.save_top_k", None, c.only(c.checkpoints, "checkpoint.save_top_k"),
                               "unset, every checkpoint is kept (-1); rlflow also writes `last.ckpt`", kind=int),
    "save_only_model": mapped(RUN, "checkpoint.save_weights_only", False,
                              c.only(c.checkpoints, "checkpoint.save_weights_only"),
                              "such a checkpoint cannot resume a run, in either"),
    **explained(RUN, "rank 0 writes rlflow's checkpoints (under FSDP2 each rank its shard)", save_on_each_node=False),
    **explained(RUN, "rlflow writes a checkpoint at the step boundary on SIGTERM or SIGINT by itself",
                enable_jit_checkpoint=False),
    **explained(RUN, "a TRL checkpoint; rlflow resumes its own (`--ckpt_path last`): start from the TRL "
                "checkpoint's weights with `model.model_path`", resume_from_checkpoint=None),
    **explained(RUN, "rlflow's resume restores the callbacks' state and the prompt order itself",
                restore_callback_states_from_checkpoint=False, ignore_data_skip=False),
    **explained(RUN, "rlflow keeps the best checkpoints by a metric (`checkpoint.monitor`, `checkpoint.mode`, "
                "`checkpoint.save_top_k`) and reloads none at the end", load_best_model_at_end=False,
                metric_for_best_model=None, greater_is_better=None),
    **explained(RUN, "environment variables TRL's parser sets: set them before `rlflow fit`", env=None),
    **explained(RUN, "`rlflow fit` trains (evaluating where `data.eval_data_path` is set), `rlflow validate` "
                "evaluates", do_train=False, do_eval=False, do_predict=False),
}

LOGGING_FIELDS: dict[str, Field] = {
    "report_to": mapped(LOGGING, "trainer.logger", "none", c.loggers,
                        "`wandb`, `tensorboard` and `mlflow` are Lightning's loggers; `none` keeps Lightning's "
                        "default logger", kind=object),
    "run_name": mapped(LOGGING, "trainer.logger", None, c.loggers, "the W&B or MLflow run's name", kind=str),
    "disable_tqdm": mapped(LOGGING, "trainer.enable_progress_bar", None, c.progress_bar, kind=bool),
    "log_completions": mapped(LOGGING, "samples.every_n_steps", False, c.samples_every,
                              "`false` turns rlflow's W&B tables off; `trajectories.jsonl` holds every completion "
                              "either way (`trajectories.enabled`)"),
    "num_completions_to_print": mapped(LOGGING, "samples.num_samples", None, kind=int),
    "log_unique_prompts": mapped(LOGGING, "samples.unique_prompts", False,
                                 note="one row per prompt, its first completion"),
    **explained(LOGGING, "rlflow logs every rollout step's metrics", logging_steps=10, logging_strategy="steps",
                logging_first_step=False),
    **explained(LOGGING, "a step whose loss or gradient is not finite is skipped and counted "
                "(`model.update.max_consecutive_skipped_steps`)", logging_nan_inf_filter=True),
    **explained(LOGGING, "rlflow logs on rank 0", log_level="passive", log_level_replica="warning",
                log_on_each_node=True),
    **explained(LOGGING, "rlflow logs `num_tokens` every step", include_num_input_tokens_seen="no"),
    **explained(LOGGING, "transformers' memory report of its Trainer", skip_memory_metrics=True),
    **explained(LOGGING, "Trackio's settings; rlflow logs to Lightning's loggers (`trainer.logger`)",
                project="huggingface", trackio_space_id=None, trackio_bucket_id=None, trackio_static_space_id=None),
    **explained(LOGGING, "rlflow's tables show the text", log_multimodal=True),
}

EVAL_FIELDS: dict[str, Field] = {
    "eval_strategy": mapped(EVAL, EVAL_KEYS, "no", c.evaluation,
                            "not `no`: `dataset_test_split` is evaluated every `eval_steps` (in rollout steps) or once "
                            "an epoch, with `num_generations_eval` completions per prompt at `temperature`"),
    "eval_steps": mapped(EVAL, "evaluate_every_n_steps", None, c.only(c.evaluation, "evaluate_every_n_steps"),
                         "optimizer steps in TRL, rollout steps in rlflow: converted; unset, `logging_steps`",
                         kind=float),
    "num_generations_eval": mapped(EVAL, "data.eval.k", None, c.only(c.evaluation, "data.eval.k"),
                                   "unset, `num_generations`", kind=int),
    "per_device_eval_batch_size": mapped(EVAL, "data.eval.batch_size", 8,
                                         c.only(c.evaluation, "data.eval.batch_size"),
                                         "prompts in rlflow: it x processes / `data.eval.k`"),
    **explained(EVAL, "rlflow evaluates every `evaluate_every_n_steps` rollout steps, or once an epoch",
                eval_delay=0, eval_on_start=False),
    **explained(EVAL, "transformers' evaluation loop; rlflow's evaluation samples and judges (`eval/accuracy`, "
                "`eval/pass@k`)", eval_accumulation_steps=None, eval_do_concat_batches=True,
                eval_use_gather_object=False, prediction_loss_only=False, include_for_metrics=[],
                batch_eval_metrics=False, bf16_full_eval=False, fp16_full_eval=False),
}

VLLM_NOTE = ("vLLM's own settings; rlflow generates with its `engine` or LMDeploy (`data.rollout`; "
             "`--data.rollout.help engine` lists their options)")
CORRECTION = ("with `use_vllm` only, as in TRL; rlflow's engine samples in the trainer's precision, so its correction "
              "is off on-policy and `token_truncate` when pipelined (`data.pipeline.max_staleness` > 0)")
CORRECTION_KEYS = ("model.rollout_correction.mode", "model.rollout_correction.cap", "model.rollout_correction.min")
BACKEND_FIELDS: dict[str, Field] = {
    **explained(BACKENDS, "rlflow generates with its own `engine` (CPU or GPU) or LMDeploy: `data.rollout` (`auto` "
                "picks one)", use_vllm=False),
    **explained(BACKENDS, VLLM_NOTE, vllm_mode="colocate", vllm_model_impl="vllm", vllm_enable_sleep_mode=False,
                vllm_server_base_url=None, vllm_server_host="0.0.0.0", vllm_server_port=8000,
                vllm_server_timeout=240.0, vllm_group_port=51216, vllm_gpu_memory_utilization=0.3,
                vllm_max_model_length=None, vllm_tensor_parallel_size=1),
    **explained(BACKENDS, "rlflow has no structured outputs", vllm_structured_outputs_regex=None),
    **explained(BACKENDS, "rlflow's `engine` back-end batches continuously itself", use_transformers_paged=False,
                use_transformers_continuous_batching=False, transformers_continuous_batching_config=None),
    "vllm_importance_sampling_correction": mapped(BACKENDS, CORRECTION_KEYS, True, c.rollout_correction, CORRECTION),
    "vllm_importance_sampling_mode": mapped(BACKENDS, "model.rollout_correction.mode", "sequence_mask",
                                            c.only(c.rollout_correction, "model.rollout_correction.mode"),
                                            "the same modes"),
    "vllm_importance_sampling_clip_max": mapped(BACKENDS, "model.rollout_correction.cap", 3.0,
                                                c.only(c.rollout_correction, "model.rollout_correction.cap"),
                                                kind=float),
    "vllm_importance_sampling_cap": mapped(BACKENDS, "model.rollout_correction.cap", None,
                                           c.only(c.rollout_correction, "model.rollout_correction.cap"),
                                           "`vllm_importance_sampling_clip_max`'s older name", kind=float),
    "vllm_importance_sampling_clip_min": mapped(BACKENDS, "model.rollout_correction.min", None,
                                                c.only(c.rollout_correction, "model.rollout_correction.min"),
                                                "the `*_mask` modes", kind=float),
}

HARDWARE_FIELDS: dict[str, Field] = {
    "bf16": mapped(HARDWARE, "trainer.precision", None, c.precision,
                   "`bf16-mixed` (TRL's default where `fp16` is off); the weights stay `model.policy.dtype`",
                   kind=bool),
    "fp16": mapped(HARDWARE, "trainer.precision", False, c.precision, "`16-mixed`"),
    "use_cpu": mapped(HARDWARE, "trainer.accelerator", False, c.flag("trainer.accelerator", "cpu"), "`cpu`"),
    **explained(HARDWARE, "rlflow leaves torch's float32 matmul precision as it is", tf32=None),
    **explained(HARDWARE, "rlflow runs the policy without `torch.compile`", torch_compile=False,
                torch_compile_backend=None, torch_compile_mode=None),
    **explained(HARDWARE, "rlflow computes log-probs in chunks (`model.update.logprob_chunk_size`) instead of "
                "Liger's fused kernels", use_liger_kernel=False, liger_kernel_config=None),
    **explained(HARDWARE, "the training forward caches nothing; the engine keeps its own KV cache", use_cache=False),
    **explained(HARDWARE, "rlflow trains padding-free packed micro-batches (`model.update.packing`)",
                pad_to_multiple_of="auto"),
    **explained(HARDWARE, "transformers' own memory and debugging switches", torch_empty_cache_steps=None, debug=""),
}

DISTRIBUTED_FIELDS: dict[str, Field] = {
    **explained(DISTRIBUTED, "set by the launcher", local_rank=-1),
    **explained(DISTRIBUTED, "DDP's options: Lightning's `trainer.strategy`", ddp_find_unused_parameters=None,
                ddp_bucket_cap_mb=None, ddp_broadcast_buffers=None, ddp_static_graph=None, ddp_backend=None,
                ddp_timeout=1800, ignore_bias_buffers=False),
    **explained(DISTRIBUTED, "rlflow shards with FSDP2: `trainer.strategy: fsdp2` (or `fsdp2_bf16`, "
                "`fsdp2_cpu_offload`)", fsdp=None, fsdp_config=None, deepspeed=None),
    **explained(DISTRIBUTED, "rlflow gathers FSDP2-sharded weights for generation itself",
                ds3_gather_for_generation=True),
    **explained(DISTRIBUTED, "accelerate's settings: Lightning's `trainer.strategy`, `trainer.devices`, "
                "`trainer.num_nodes`", accelerator_config=None, parallelism_config=None),
    **explained(DISTRIBUTED, "rlflow's data module draws each rollout step's prompts itself, without DataLoader "
                "workers", dataloader_drop_last=False, dataloader_num_workers=0, dataloader_pin_memory=True,
                dataloader_persistent_workers=False, dataloader_prefetch_factor=None,
                dataloader_multiprocessing_context=None, dataloader_in_order=True),
    **explained(DISTRIBUTED, "transformers' sampler options; rlflow's prompt order is a seeded shuffle (`data.seed`)",
                train_sampling_strategy="random", length_column_name="length", label_names=None),
}

HUB_FIELDS: dict[str, Field] = explained(
    HUB, "rlflow writes the trained model as a Hugging Face directory (`<log_dir>/hf`, or `rlflow export`): upload "
    "it with `huggingface-cli upload`", push_to_hub=False, hub_token=None, hub_private_repo=None, hub_model_id=None,
    hub_strategy="every_save", hub_always_push=False, hub_revision=None, log_completions_hub_repo=None)

#: Every field, by name.
FIELDS: dict[str, Field] = {
    **MODEL_FIELDS, **DATA_FIELDS, **BATCH_FIELDS, **GENERATION_FIELDS, **LOSS_FIELDS, **REWARD_FIELDS,
    **OPTIM_FIELDS, **RUN_FIELDS, **LOGGING_FIELDS, **EVAL_FIELDS, **BACKEND_FIELDS, **HARDWARE_FIELDS,
    **DISTRIBUTED_FIELDS, **HUB_FIELDS,
}
#: Fields of older TRL and transformers versions, still read (TRL's current config has none of them).
OLDER = ("max_prompt_length", "warmup_ratio")
#: Fields TRL's parser itself reads from a config file (beside the dataclasses' fields).
PARSER = ("env",)
#: Fields of transformers releases newer than the oldest rlflow supports (5.23's ``TrainingArguments``), read
#: whether or not the installed one has them.
NEWER = ("activation_checkpointing", "activation_checkpointing_kwargs")
