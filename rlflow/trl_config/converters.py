"""The conversions of TRL values to rlflow keys: each ``(value, run) -> {rlflow key: value}`` for one TRL field,
reading the rest of the run where the rlflow value depends on other fields; ``{}`` where the value leaves
rlflow's behaviour as TRL's (an option of a loss not in use, an unset optional value), :class:`NotConverted`
where it has no mechanical counterpart."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlflow.trl_config.run import NotConverted, TrlRun

Convert = Callable[[Any, TrlRun], dict[str, Any]]

LOSS = "model.loss.init_args."
CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
LOSS_TYPES = (*CLIPPED_LOSSES, "cispo", "sapo", "vespo")
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "half": "float16", "float": "float32"}
SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
OPTIMIZERS = {"adamw_torch": "adamw", "adamw_torch_fused": "adamw"}
LOGGERS = {"wandb": "lightning.pytorch.loggers.WandbLogger",
           "tensorboard": "lightning.pytorch.loggers.TensorBoardLogger",
           "mlflow": "lightning.pytorch.loggers.MLFlowLogger"}
#: TRL's script's reward names: (judger spec, the name TRL logs its rewards under).
TRL_REWARDS: dict[str, tuple[Any, str]] = {
    "accuracy_reward": ("trl.rewards:accuracy_reward", "accuracy_reward"),
    "reasoning_accuracy_reward": ("trl.rewards:reasoning_accuracy_reward", "reasoning_accuracy_reward"),
    "think_format_reward": ("trl.rewards:think_format_reward", "think_format_reward"),
    "get_soft_overlong_punishment": (
        {"class_path": "function", "init_args": {"path": "trl.rewards:get_soft_overlong_punishment",
                                                 "factory_kwargs": {"max_completion_len": 1280,
                                                                    "soft_punish_cache": 256}}},
        "soft_overlong_punishment_reward"),
}
DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv")


def to(key: str) -> Convert:
    """The value as it is under ``key`` (an unset optional value: nothing)."""
    return lambda value, run: {} if value is None else {key: value}


def when(condition: Callable[[TrlRun], bool], convert: Convert) -> Convert:
    """``convert`` where ``condition(run)`` holds; nothing otherwise (an option of a feature not in use)."""
    return lambda value, run: convert(value, run) if condition(run) else {}


def only(convert: Convert, *keys: str) -> Convert:
    """``convert``'s output under ``keys`` (one field's share of a conversion several fields give)."""
    return lambda value, run: {k: v for k, v in convert(value, run).items() if k in keys}


def loss_is(*names: str) -> Callable[[TrlRun], bool]:
    return lambda run: run["loss_type"] in names


# ------------------------------------------------------------------------------------------------ model
def policy_dtype(value: Any, run: TrlRun) -> dict[str, Any]:
    kwargs = run["model_init_kwargs"] or {}
    if "dtype" in kwargs or "torch_dtype" in kwargs:
        return {}  # TRL's script lets model_init_kwargs override the model arguments
    return _dtype(value)


def _dtype(value: Any) -> dict[str, Any]:
    if value is None or value == "auto":
        raise NotConverted("rlflow's parameter dtype is explicit: set model.policy.dtype (float32 keeps master "
                           "weights; trainer.precision: bf16-mixed computes in bf16)")
    name = str(value).removeprefix("torch.")
    if name not in DTYPES:
        raise NotConverted(f"dtype {value!r}: rlflow's are float32, bfloat16 and float16")
    return {"model.policy.dtype": DTYPES[name]}


def model_init_kwargs(value: Any, run: TrlRun) -> dict[str, Any]:
    if not value:
        return {}
    out: dict[str, Any] = {}
    dtype = value.get("dtype", value.get("torch_dtype"))
    if dtype is not None:
        out.update(_dtype(dtype))
    if value.get("attn_implementation") is not None:
        out["model.policy.attn_implementation"] = value["attn_implementation"]
    rest = sorted(set(value) - {"dtype", "torch_dtype", "attn_implementation"})
    if rest:
        raise NotConverted(f"keys {', '.join(rest)}: rlflow loads the model itself (model.policy)"
                           + (f"; converted: {', '.join(sorted(out))}" if out else ""))
    return out


def lora(key: str) -> Convert:
    """A LoRA option, under ``key`` where ``use_peft`` is set."""
    return when(lambda run: bool(run["use_peft"]), to(key))


def lora_option(key: str) -> Convert:
    """One of PEFT's other ``LoraConfig`` options, under ``key`` where ``use_peft`` is set and the option is on."""
    return lambda value, run: {key: value} if run["use_peft"] and value else {}


def lora_target_modules(value: Any, run: TrlRun) -> dict[str, Any]:
    if not run["use_peft"]:
        return {}
    if value is None:
        raise NotConverted("unset, PEFT adapts its default modules of the architecture (q_proj and v_proj for "
                           "most); rlflow's default is all-linear: set model.lora.target_modules")
    return {"model.lora.target_modules": value}


def lora_task_type(value: Any, run: TrlRun) -> dict[str, Any]:
    if run["use_peft"] and value != "CAUSAL_LM":
        raise NotConverted(f"{value!r}: rlflow trains causal language models (task type CAUSAL_LM)")
    return {}


def reference_mixup(value: Any, run: TrlRun) -> dict[str, Any]:
    return {"model.reference.mixup_alpha": value} if run["sync_ref_model"] else {}


def reference_sync(value: Any, run: TrlRun) -> dict[str, Any]:
    if not run["sync_ref_model"]:
        return {}  # a fixed reference: rlflow's default
    return {"model.reference.sync_steps": run.rollout_steps(run["ref_model_sync_steps"])}


# ------------------------------------------------------------------------------------------------ data
def _split_files(root: Path, split: str) -> list[Path]:
    files = [f for f in root.rglob("*") if f.is_file() and f.suffix in DATA_SUFFIXES
             and not any(part.startswith(".") for part in f.relative_to(root).parts)]
    return sorted(f for f in files if f.stem == split or f.name.startswith((f"{split}-", f"{split}_"))
                  or split in f.relative_to(root).parts[:-1])


def local_split(name: str, split: str) -> str:
    """The rlflow data path of ``split`` of the local dataset ``name`` (a file, a ``save_to_disk`` directory or a
    directory of data files, as ``datasets.load_dataset`` finds its splits)."""
    root = Path(name).expanduser()
    if root.is_file():
        if split != "train":
            raise NotConverted(f"{name} is one file, which datasets reads as the split 'train', not {split!r}")
        return name
    if (root / "dataset_dict.json").is_file():
        return str(root / split)
    files = _split_files(root, split)
    if len(files) == 1:
        return str(files[0])
    if files:
        suffixes = {f.suffix for f in files}
        shards = [f for f in files if f.name.startswith(f"{split}-")]
        if len(suffixes) == 1 and len(shards) == len(files):
            return f"{root}/**/{split}-*{files[0].suffix}"
        raise NotConverted(f"{name}: several files of the split {split!r}; name them in a glob")
    if split == "train" and not _split_files(root, "test") and not _split_files(root, "validation"):
        return name  # a directory without split names: datasets reads it all as 'train'
    raise NotConverted(f"{name}: no files of the split {split!r} (named {split}.jsonl, {split}-*.parquet, ...)")


def hub_split(name: str, config: str | None, split: str) -> str:
    """The rlflow data path of ``split`` of the hub dataset ``name`` (configuration ``config``)."""
    query = "&".join(f"{k}={v}" for k, v in (("config", config), ("split", split)) if v is not None)
    return f"hf://{name}?{query}"


def dataset_path(run: TrlRun, split: str) -> str:
    name, config = run["dataset_name"], run["dataset_config"]
    if Path(str(name)).expanduser().exists():
        if config is not None:
            raise NotConverted(f"dataset_config={config!r} names a configuration of a hub dataset, but "
                               f"{name} is a local path")
        return local_split(str(name), split)
    return hub_split(str(name), config, split)


def train_data(value: Any, run: TrlRun) -> dict[str, Any]:
    if run["dataset_name"] is None:
        return {}
    return {"data.train_data_path": dataset_path(run, run["dataset_train_split"])}


# ------------------------------------------------------------------------------------------------ batches
def global_batch(value: Any, run: TrlRun) -> dict[str, Any]:
    return {"data.global_batch_size": run.prompts_per_step()}


def update_steps(value: Any, run: TrlRun) -> dict[str, Any]:
    return {"data.global_batch_size": run.prompts_per_step(), "model.update.optimizer_steps": run.optimizer_steps()}


def group_size(value: Any, run: TrlRun) -> dict[str, Any]:
    return {"data.prompt_repeat_k": value, **global_batch(value, run)}


def micro_batch(value: Any, run: TrlRun) -> dict[str, Any]:
    return {"model.update.micro_batch_size": value, **global_batch(value, run)}


def run_length(value: Any, run: TrlRun) -> dict[str, Any]:
    if run["max_steps"] > 0:
        return {"trainer.max_steps": run.rollout_steps(run["max_steps"])}
    epochs = run["num_train_epochs"]
    if epochs != int(epochs):
        raise NotConverted(f"num_train_epochs={epochs}: rlflow runs whole epochs; set trainer.max_steps (rollout "
                           "steps) for a part of one")
    return {"trainer.max_epochs": int(epochs)}


def max_turns(value: Any, run: TrlRun) -> dict[str, Any]:
    return {} if value is None else {"data.multiturn.max_turns": value + 1}


# ------------------------------------------------------------------------------------------------ loss
def loss_type(value: Any, run: TrlRun) -> dict[str, Any]:
    if value not in LOSS_TYPES:
        raise NotConverted(f"{value!r} is none of TRL's loss types ({', '.join(LOSS_TYPES)})")
    return {"model.loss.class_path": value}


def epsilon_high(value: Any, run: TrlRun) -> dict[str, Any]:
    high = run["epsilon"] if value is None else value
    if run["loss_type"] != "cispo":
        return {LOSS + "epsilon_high": high}
    if high < 1.0:
        raise NotConverted(f"cispo's cap (epsilon_high, else epsilon) is {high}, below 1; rlflow's cispo caps the "
                           "ratio at 1 + model.loss.init_args.epsilon_high")
    return {LOSS + "epsilon_high": round(high - 1.0, 12)}


def kl_option(name: str) -> Convert:
    """A KL option, where the loss has a KL term (``beta`` > 0)."""
    return when(lambda run: run["beta"] > 0, to(LOSS + name))


def adaptive_entropy(name: str) -> Convert:
    return when(lambda run: bool(run["use_adaptive_entropy"]), to(LOSS + name))


# ------------------------------------------------------------------------------------------------ rewards
def _reward_func(name: Any) -> tuple[Any, str]:
    text = str(name)
    if text in TRL_REWARDS:
        return TRL_REWARDS[text]
    module, _, attr = text.replace(":", ".").rpartition(".")
    if not module or not attr:
        raise ValueError(f"reward function {text!r} is neither one of TRL's ({', '.join(TRL_REWARDS)}) nor an "
                         "import path (my_lib.rewards.custom_reward)")
    return f"{module}:{attr}", attr


def judgers(value: Any, run: TrlRun) -> dict[str, Any]:
    """``reward_model_name_or_path`` and ``reward_funcs`` (in TRL's order) as judgers of every data source, named
    as TRL names them where ``reward_weights`` needs names."""
    specs: list[tuple[Any, str]] = []
    if run["reward_model_name_or_path"]:
        path = str(run["reward_model_name_or_path"])
        specs.append(({"class_path": "reward_model", "init_args": {"model_path": path}},
                      path.rstrip("/").split("/")[-1]))
    specs += [_reward_func(name) for name in run["reward_funcs"] or []]
    if not specs:
        return {}
    weights = run["reward_weights"]
    if weights is None:
        return {"data.judging.judgers": {"*": [spec for spec, _ in specs]}}
    if len(weights) != len(specs):
        raise ValueError(f"reward_weights has {len(weights)} weights for {len(specs)} reward functions")
    names = _unique([name for _, name in specs])
    named = [_named(spec, name) for (spec, _), name in zip(specs, names)]
    return {"data.judging.judgers": {"*": named}, "data.judging.weights": dict(zip(names, map(float, weights)))}


def _unique(names: list[str]) -> list[str]:
    out: list[str] = []
    for name in names:
        out.append(name if name not in out else f"{name}_{sum(n.startswith(name) for n in out) + 1}")
    return out


def _named(spec: Any, name: str) -> dict[str, Any]:
    if isinstance(spec, str):
        return {"class_path": "function", "init_args": {"path": spec, "name": name}}
    return {"class_path": spec["class_path"], "init_args": {**spec["init_args"], "name": name}}


def advantage(value: Any, run: TrlRun) -> dict[str, Any]:
    aggregation = run["multi_objective_aggregation"]
    if aggregation == "normalize_then_sum":
        return {"data.advantage.class_path": "gdpo"}
    if aggregation != "sum_then_normalize":
        raise NotConverted(f"multi_objective_aggregation={aggregation!r}: TRL's are sum_then_normalize and "
                           "normalize_then_sum")
    scale = {True: "group", False: "none"}.get(run["scale_rewards"], run["scale_rewards"])
    if scale not in ("group", "batch", "none"):
        raise NotConverted(f"scale_rewards={scale!r}: TRL's are group, batch and none")
    return {"data.advantage.class_path": "grpo", "data.advantage.init_args.scale_rewards": scale}


# ------------------------------------------------------------------------------------------------ optimizer
def optimizer(value: Any, run: TrlRun) -> dict[str, Any]:
    name = str(value)
    if name not in OPTIMIZERS:
        raise NotConverted(f"{name}: rlflow's optimizers are AdamW (adamw) and, for bf16 weights, adamw_kahan and "
                           "adamw_bf16_sr (model.optim.optimizer)")
    return {"model.optim.optimizer": OPTIMIZERS[name]}


def betas(value: Any, run: TrlRun) -> dict[str, Any]:
    return {"model.optim.betas": [run["adam_beta1"], run["adam_beta2"]]}


def adam_epsilon(value: Any, run: TrlRun) -> dict[str, Any]:
    if value != 1e-8:
        raise NotConverted(f"{value}: rlflow's AdamW uses torch's eps of 1e-8")
    return {}


def grad_norm(value: Any, run: TrlRun) -> dict[str, Any]:
    return {"model.optim.max_grad_norm": value if value and value > 0 else None}


def schedule(value: Any, run: TrlRun) -> dict[str, Any]:
    name = str(value).removeprefix("SchedulerType.").lower()
    if name not in SCHEDULES:
        raise NotConverted(f"{name}: rlflow's schedules are constant, linear and cosine after a linear warm-up "
                           "(model.optim.lr_schedule)")
    return {"model.optim.lr_schedule": SCHEDULES[name]}


def warmup(value: Any, run: TrlRun) -> dict[str, Any]:
    """``warmup_steps`` (or the older ``warmup_ratio``): optimizer steps in both; a fraction (< 1) of the run where
    the run's length in optimizer steps is known (``max_steps``), as transformers' ``get_warmup_steps``."""
    if str(run["lr_scheduler_type"]).lower() == "constant":
        return {"model.optim.warmup_steps": 0}  # transformers' constant schedule has no warm-up
    steps = run["warmup_steps"]
    if steps >= 1:
        return {"model.optim.warmup_steps": int(steps)}
    fraction = steps if steps > 0 else (run["warmup_ratio"] or 0.0)
    if fraction == 0:
        return {"model.optim.warmup_steps": 0}
    if run["max_steps"] <= 0:
        raise NotConverted(f"a warm-up of {fraction} of the run, whose length in optimizer steps follows from the "
                           "dataset's size: set model.optim.warmup_steps (optimizer steps)")
    return {"model.optim.warmup_steps": math.ceil(run["max_steps"] * fraction)}


# ------------------------------------------------------------------------------------------------ the run
def data_seed(value: Any, run: TrlRun) -> dict[str, Any]:
    """The prompt order's seed: ``data_seed``, else ``seed``."""
    return {"data.seed": run["data_seed"] if run["data_seed"] is not None else run["seed"]}


def seeds(value: Any, run: TrlRun) -> dict[str, Any]:
    return {"seed_everything": value, **data_seed(value, run)}


def checkpoints(value: Any, run: TrlRun) -> dict[str, Any]:
    strategy = str(run["save_strategy"]).removeprefix("SaveStrategy.").lower()
    keep = run["save_total_limit"]
    out: dict[str, Any] = {"checkpoint.save_top_k": -1 if keep is None else keep}
    if run["save_only_model"]:
        out["checkpoint.save_weights_only"] = True
    if strategy == "no":
        return {"trainer.enable_checkpointing": False}
    if strategy == "epoch":
        return {**out, "checkpoint.every_n_train_steps": 0, "checkpoint.every_n_epochs": 1}
    if strategy != "steps":
        raise NotConverted(f"save_strategy={strategy}: rlflow saves every checkpoint.every_n_train_steps rollout "
                           "steps, keeping the best by checkpoint.monitor")
    if run["save_steps"] < 1:
        raise NotConverted(f"save_steps={run['save_steps']} is a fraction of the run: set "
                           "checkpoint.every_n_train_steps (rollout steps)")
    return {**out, "checkpoint.every_n_train_steps": run.rollout_steps(run["save_steps"])}


def precision(value: Any, run: TrlRun) -> dict[str, Any]:
    if run["fp16"]:
        return {"trainer.precision": "16-mixed"}
    bf16 = run["bf16"]
    return {"trainer.precision": "bf16-mixed"} if bf16 or bf16 is None else {}


def flag(key: str, value_when_set: Any = True) -> Convert:
    """``key: value_when_set`` where the TRL flag is on; nothing where it is off."""
    return lambda value, run: {key: value_when_set} if value else {}


def progress_bar(value: Any, run: TrlRun) -> dict[str, Any]:
    return {} if value is None else {"trainer.enable_progress_bar": not value}


def loggers(value: Any, run: TrlRun) -> dict[str, Any]:
    names = run["report_to"]
    names = [names] if isinstance(names, str) else list(names or [])
    if names in ([], ["none"]):
        return {}
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise NotConverted(f"report_to {', '.join(map(str, unknown))}: rlflow converts wandb, tensorboard and mlflow "
                           "to Lightning loggers (trainer.logger)")
    made = [_logger(name, run) for name in names]
    return {"trainer.logger": made[0] if len(made) == 1 else made}


def _logger(name: str, run: TrlRun) -> dict[str, Any]:
    init: dict[str, Any] = {}
    if name == "tensorboard":
        init["save_dir"] = run["output_dir"] or "."
    elif run["run_name"]:
        init["name" if name == "wandb" else "run_name"] = run["run_name"]
    return {"class_path": LOGGERS[name], "init_args": init} if init else {"class_path": LOGGERS[name]}


def samples_every(value: Any, run: TrlRun) -> dict[str, Any]:
    return {} if value else {"samples.every_n_steps": 0}


# ------------------------------------------------------------------------------------------------ evaluation
def evaluation(value: Any, run: TrlRun) -> dict[str, Any]:
    """Where TRL evaluates: the test split, how often, and its sampling (``num_generations_eval`` completions
    per prompt at the training temperature)."""
    if not run.evaluating or run["dataset_name"] is None:
        return {}
    k = run["num_generations_eval"] or run["num_generations"]
    out: dict[str, Any] = {"data.eval_data_path": dataset_path(run, run["dataset_test_split"]), "data.eval.k": k,
                           "data.eval.temperature": run["temperature"],
                           "data.eval.batch_size": max(1, run["per_device_eval_batch_size"] * run.processes // k)}
    strategy = str(run["eval_strategy"]).removeprefix("IntervalStrategy.").lower()
    if strategy == "steps":
        every = run["eval_steps"] if run["eval_steps"] is not None else run["logging_steps"]
        if every < 1:
            raise NotConverted(f"eval_steps={every} is a fraction of the run: set evaluate_every_n_steps (rollout "
                               "steps)")
        out["evaluate_every_n_steps"] = run.rollout_steps(every)
    elif strategy != "epoch":
        raise NotConverted(f"eval_strategy={strategy}: rlflow evaluates every evaluate_every_n_steps rollout steps "
                           "or once an epoch")
    return out


def rollout_correction(value: Any, run: TrlRun) -> dict[str, Any]:
    """TRL's correction of vLLM's sampling probabilities (only with ``use_vllm``, as in TRL)."""
    if not run["use_vllm"]:
        return {}
    if not run["vllm_importance_sampling_correction"]:
        return {"model.rollout_correction.mode": "off"}
    mode = run["vllm_importance_sampling_mode"]
    cap = run["vllm_importance_sampling_cap"] or run["vllm_importance_sampling_clip_max"]
    low = run["vllm_importance_sampling_clip_min"]
    if cap is None:
        raise NotConverted("no upper bound (vllm_importance_sampling_clip_max: null): rlflow's correction always "
                           "has one (model.rollout_correction.cap)")
    if low is not None and mode.endswith("_truncate"):
        raise NotConverted(f"a lower bound with {mode}: rlflow's truncation clips from above only "
                           "(model.rollout_correction.min masks, with the *_mask modes)")
    out = {"model.rollout_correction.mode": mode, "model.rollout_correction.cap": cap}
    return {**out, "model.rollout_correction.min": low} if low is not None else out
