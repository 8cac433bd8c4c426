"""TRL configs in rlflow (:mod:`rlflow.trl_config`): every field of the installed TRL's ``GRPOConfig`` (and of the
``trl grpo`` script's arguments) is mapped or explained, with TRL's default; the guide's tables are the table's;
each conversion against hand-worked values; the converted config is one ``rlflow fit`` accepts."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from rlflow.config_error import ConfigError
from rlflow.trl_config import page
from rlflow.trl_config.command import convert, from_trl, main
from rlflow.trl_config.fields import FIELDS, NEWER, OLDER, PARSER
from rlflow.trl_config.run import TrlRun
from tests.helpers.paths import ROOT

trl = pytest.importorskip("trl", reason="TRL is not installed (it is in the dev extra)")


def trl_classes() -> list[type]:
    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig
    from trl.scripts.grpo import GRPOScriptArguments

    return [GRPOConfig, GRPOScriptArguments, ModelConfig, DatasetMixtureConfig]


def trl_fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for cls in trl_classes() for f in dataclasses.fields(cls)}


def unaccounted(names, table) -> list[str]:
    """The fields ``table`` neither maps to an rlflow key nor explains."""
    return [name for name in names if name not in table or not (table[name].keys or table[name].note.strip())]


# ------------------------------------------------------------------------------------------------ the table
def test_every_grpo_config_field_is_mapped_or_explained():
    from trl import GRPOConfig

    names = [f.name for f in dataclasses.fields(GRPOConfig)]
    assert len(names) > 150  # TrainingArguments' fields are in it
    assert unaccounted(names, FIELDS) == []
    assert unaccounted(trl_fields(), FIELDS) == []  # the script's, ModelConfig's and the mixture's too


def test_a_field_missing_from_the_table_fails_the_check():
    from trl import GRPOConfig

    names = [f.name for f in dataclasses.fields(GRPOConfig)]
    for gone in ("learning_rate", "ddp_timeout", "vespo_k_pos"):
        table = {name: spec for name, spec in FIELDS.items() if name != gone}
        assert unaccounted(names, table) == [gone]
    silent = {**FIELDS, "ddp_timeout": dataclasses.replace(FIELDS["ddp_timeout"], note=" ")}
    assert unaccounted(names, silent) == ["ddp_timeout"]  # no key and no reason: not explained


def test_the_table_holds_only_trl_fields_and_the_named_older_ones():
    assert set(FIELDS) - set(trl_fields()) - set(NEWER) == {*OLDER, *PARSER}


def test_defaults_are_the_installed_trls():
    """A field the file leaves out takes this default: it must be TRL's."""
    wrong = {}
    for name, f in trl_fields().items():
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if FIELDS[name].default != default:
            wrong[name] = (FIELDS[name].default, default)
    assert wrong == {}


def test_values_are_read_as_the_types_trl_declares():
    mismatched = {name: (FIELDS[name].value_type, str(f.type)) for name, f in trl_fields().items()
                  if FIELDS[name].convert is not None and FIELDS[name].value_type in (bool, int, float)
                  and FIELDS[name].value_type.__name__ not in str(f.type)}
    assert mismatched == {}


def test_the_guides_tables_are_the_tables_and_name_every_field():
    assert page.main(["--check"]) == 0
    text = page.PAGE.read_text()
    assert all(f"`{name}`" in text for name in FIELDS)
    assert all(f"`{key}`" in text for spec in FIELDS.values() for key in spec.keys)


def test_the_check_fails_on_stale_tables_and_the_writer_mends_them(tmp_path):
    stale = tmp_path / "from_trl.md"
    stale.write_text(f"# Coming from TRL\n\n{page.BEGIN}\n| `old` | table |\n{page.END}\n\nafter\n")
    assert page.main(["--check"], page=stale) == 1
    assert page.main([], page=stale) == 0
    assert page.main(["--check"], page=stale) == 0
    text = stale.read_text()
    assert "`old`" not in text and "| `learning_rate` | `model.optim.lr` |" in text and text.endswith("after\n")
    with pytest.raises(ValueError, match="markers"):
        page.with_tables("no markers")


# ------------------------------------------------------------------------------------------------ conversions
def converted(**given) -> dict:
    """The flat rlflow config of the TRL fields ``given`` (one process)."""
    return convert(given).flat


def skipped(**given) -> dict[str, str]:
    return {name: reason for reason, names in convert(given).skipped.items() for name in names}


def test_loss_fields():
    out = converted(loss_type="grpo", epsilon=0.2, epsilon_high=0.28, delta=1.5, beta=0.04)
    assert out["model.loss.class_path"] == "grpo"
    assert out["model.loss.init_args.epsilon_low"] == 0.2 and out["model.loss.init_args.epsilon_high"] == 0.28
    assert out["model.loss.init_args.delta"] == 1.5
    assert out["model.loss.init_args.kl_coef"] == 0.04 and out["model.loss.init_args.use_bias_correction_kl"] is True
    default = converted()
    assert default["model.loss.class_path"] == "dapo"  # TRL's default, not rlflow's bnpo
    assert default["model.loss.init_args.epsilon_high"] == 0.2  # unset: epsilon, as in TRL
    assert "model.loss.init_args.use_bias_correction_kl" not in default  # no KL term
    for name in ("bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"):
        assert converted(loss_type=name, epsilon_high=5.0)["model.loss.class_path"] == name
    # cispo: TRL's epsilon_high is the cap, rlflow's cap is 1 + epsilon_high
    assert converted(loss_type="cispo", epsilon_high=5.0)["model.loss.init_args.epsilon_high"] == 4.0
    assert "below 1" in skipped(loss_type="cispo")["epsilon_high"]  # TRL caps at epsilon, 0.2
    assert "model.loss.init_args.delta" not in converted(loss_type="sapo", delta=1.5)  # TRL ignores it there
    sapo = converted(loss_type="sapo", sapo_temperature_pos=0.9, sapo_temperature_neg=1.2, vespo_k_pos=1.0)
    assert (sapo["model.loss.init_args.tau_pos"], sapo["model.loss.init_args.tau_neg"]) == (0.9, 1.2)
    assert "model.loss.init_args.k_pos" not in sapo
    vespo = converted(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_neg=2.5)
    assert (vespo["model.loss.init_args.k_pos"], vespo["model.loss.init_args.lambda_neg"]) == (1.5, 2.5)
    assert "not_a_loss" in skipped(loss_type="not_a_loss")["loss_type"]
    adaptive = converted(use_adaptive_entropy=True, entropy_target=3.0, entropy_coef=0.01)
    assert adaptive["model.loss.init_args.entropy_target"] == 3.0 and adaptive[
        "model.loss.init_args.entropy_coef"] == 0.01
    assert "model.loss.init_args.entropy_target" not in converted(entropy_target=3.0)


def test_optimizer_and_schedule():
    assert converted(learning_rate="1e-6")["model.optim.lr"] == 1e-6  # text, as TRL's parser reads it
    out = converted(learning_rate=3e-6, weight_decay=0.1, adam_beta1=0.8, adam_beta2=0.95, max_grad_norm=0.0,
                    optim="adamw_torch")
    assert (out["model.optim.lr"], out["model.optim.weight_decay"], out["model.optim.betas"]) == (3e-6, 0.1,
                                                                                                   [0.8, 0.95])
    assert out["model.optim.max_grad_norm"] is None and out["model.optim.optimizer"] == "adamw"
    assert converted()["model.optim.lr_schedule"] == "linear"  # TRL's default
    assert converted(lr_scheduler_type="cosine")["model.optim.lr_schedule"] == "cosine"
    assert converted(lr_scheduler_type="constant_with_warmup")["model.optim.lr_schedule"] == "constant"
    assert "cosine_with_restarts" in skipped(lr_scheduler_type="cosine_with_restarts")["lr_scheduler_type"]
    assert "adafactor" in skipped(optim="adafactor")["optim"]
    assert "1e-08" not in str(skipped(adam_epsilon=1e-8)) and "adam_epsilon" in skipped(adam_epsilon=1e-6)


def test_warmup():
    assert converted(warmup_steps=10)["model.optim.warmup_steps"] == 10
    assert converted(warmup_steps=0.05, max_steps=100)["model.optim.warmup_steps"] == 5  # ceil(100 x 0.05)
    assert converted(warmup_ratio=0.1, max_steps=200)["model.optim.warmup_steps"] == 20  # older transformers
    assert converted(warmup_ratio=0.1, max_steps=15)["model.optim.warmup_steps"] == 2  # ceil(1.5)
    assert converted(warmup_steps=10, lr_scheduler_type="constant")["model.optim.warmup_steps"] == 0
    assert "dataset's size" in skipped(warmup_ratio=0.1)["warmup_ratio"]  # the run's length is not known


def test_batches_and_steps():
    out = converted(num_generations=4, per_device_train_batch_size=16, gradient_accumulation_steps=2)
    # 16 x 1 process x 2 (steps_per_generation defaults to the accumulation) = 32 completions = 8 prompts
    assert (out["data.prompt_repeat_k"], out["data.global_batch_size"]) == (4, 8)
    assert (out["model.update.micro_batch_size"], out["model.update.optimizer_steps"]) == (16, 1)
    out = converted(num_generations=8, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                    steps_per_generation=4, num_iterations=2, max_steps=100, save_steps=50, ref_model_sync_steps=10,
                    sync_ref_model=True, beta=0.01)
    assert (out["data.global_batch_size"], out["model.update.optimizer_steps"]) == (4, 2)  # 32 / 8; 4 / 2
    # 2 optimizer steps x 2 iterations per rollout step
    assert out["trainer.max_steps"] == 25 and out["checkpoint.every_n_train_steps"] == 13
    assert out["model.reference.sync_steps"] == 3 and out["model.update.num_iterations"] == 2
    out = convert({"generation_batch_size": 64, "per_device_train_batch_size": 8, "num_generations": 8},
                  processes=2).config
    assert out["data"]["global_batch_size"] == 8 and out["model"]["update"]["optimizer_steps"] == 4
    reasons = skipped(steps_per_generation=1, gradient_accumulation_steps=4)
    assert "straddle" in reasons["steps_per_generation"] and "trainer.max_steps" not in converted(
        steps_per_generation=1, gradient_accumulation_steps=4, max_steps=10)
    for refused, words in (({"per_device_train_batch_size": 6}, "not a multiple of num_generations"),
                           ({"generation_batch_size": 20}, "generation_batch_size=20 is not a multiple"),
                           ({"generation_batch_size": 16, "steps_per_generation": 2}, "both set")):
        with pytest.raises(ConfigError, match=f"^the TRL config: .*{words}.*which TRL refuses"):
            convert(refused)  # TRL does not start with these: no config that would train on other batches
    assert converted(max_steps=-1, num_train_epochs=2.0)["trainer.max_epochs"] == 2
    assert "whole epochs" in skipped(num_train_epochs=1.5)["num_train_epochs"]


def test_generation_and_the_run():
    out = converted(max_completion_length=256, temperature=0.7, top_p=0.9, top_k=50, min_p=0.05,
                    repetition_penalty=1.1, seed=7, use_cpu=True, output_dir="out", max_tool_calling_iterations=3)
    assert (out["data.sampling.max_tokens"], out["data.sampling.temperature"]) == (256, 0.7)
    assert (out["data.sampling.top_p"], out["data.sampling.top_k"], out["data.sampling.min_p"]) == (0.9, 50, 0.05)
    assert out["data.sampling.repetition_penalty"] == 1.1 and out["data.multiturn.max_turns"] == 4
    assert (out["seed_everything"], out["data.seed"]) == (7, 7)
    assert (out["trainer.accelerator"], out["trainer.default_root_dir"]) == ("cpu", "out")
    assert converted(seed=7, data_seed=3)["data.seed"] == 3
    assert converted()["trainer.precision"] == "bf16-mixed"  # TRL's bf16 default where fp16 is off
    assert "trainer.precision" not in converted(bf16=False)
    assert converted(fp16=True)["trainer.precision"] == "16-mixed"
    assert converted(save_strategy="no")["trainer.enable_checkpointing"] is False
    assert converted(save_total_limit=2)["checkpoint.save_top_k"] == 2


def test_model_fields():
    out = converted(model_name_or_path="Qwen/Qwen3-0.6B", dtype="bfloat16", attn_implementation="sdpa",
                    disable_dropout=True, gradient_checkpointing=False)
    assert out["model.model_path"] == "Qwen/Qwen3-0.6B" and out["model.policy.dtype"] == "bfloat16"
    assert out["model.policy.attn_implementation"] == "sdpa" and out["model.policy.disable_dropout"] is True
    assert out["model.policy.gradient_checkpointing"] is False
    out = converted(dtype="float32", model_init_kwargs='{"torch_dtype": "bfloat16"}')  # JSON text, as TRL reads it
    assert out["model.policy.dtype"] == "bfloat16"  # the script lets model_init_kwargs win
    assert "device_map" in skipped(model_init_kwargs={"device_map": "auto"})["model_init_kwargs"]
    assert "model.lora.r" not in converted(lora_r=8)  # without use_peft TRL trains the full weights
    lora = converted(use_peft=True, lora_r=8, lora_alpha=16, lora_target_modules=["q_proj", "v_proj"], use_dora=True)
    assert (lora["model.lora.r"], lora["model.lora.alpha"], lora["model.lora.dropout"]) == (8, 16, 0.05)
    assert lora["model.lora.target_modules"] == ["q_proj", "v_proj"] and lora["model.lora.options.use_dora"] is True
    assert "all-linear" in skipped(use_peft=True)["lora_target_modules"]


def test_rewards_and_advantages(tmp_path):
    out = converted(reward_funcs=["accuracy_reward", "my_lib.rewards.custom_reward"])
    assert out["data.judging.judgers"] == {"*": ["trl.rewards:accuracy_reward", "my_lib.rewards:custom_reward"]}
    out = converted(reward_model_name_or_path="org/rm-7b", reward_funcs=["get_soft_overlong_punishment"],
                    reward_weights=[1.0, 0.5])
    rm, overlong = out["data.judging.judgers"]["*"]
    assert rm == {"class_path": "reward_model", "init_args": {"model_path": "org/rm-7b", "name": "rm-7b"}}
    assert overlong["init_args"]["factory_kwargs"] == {"max_completion_len": 1280, "soft_punish_cache": 256}
    assert out["data.judging.weights"] == {"rm-7b": 1.0, "soft_overlong_punishment_reward": 0.5}
    with pytest.raises(ConfigError, match="reward_weights has 1 weights for 2"):
        convert({"reward_funcs": ["accuracy_reward", "think_format_reward"], "reward_weights": [1.0]})
    with pytest.raises(ConfigError, match="neither one of TRL's"):
        convert({"reward_funcs": ["nodots"]})
    assert converted(scale_rewards=False)["data.advantage.init_args.scale_rewards"] == "none"
    assert converted(scale_rewards="batch")["data.advantage.init_args.scale_rewards"] == "batch"
    gdpo = converted(multi_objective_aggregation="normalize_then_sum", scale_rewards="batch")
    assert gdpo["data.advantage.class_path"] == "gdpo" and "data.advantage.init_args.scale_rewards" not in gdpo


def test_datasets_and_evaluation(tmp_path):
    local = tmp_path / "data"
    local.mkdir()
    for name in ("train.jsonl", "test.jsonl"):
        (local / name).write_text("{}\n")
    out = converted(dataset_name=str(local), eval_strategy="steps", eval_steps=20, num_generations=4,
                    per_device_train_batch_size=8, gradient_accumulation_steps=2, steps_per_generation=4,
                    temperature=0.8)
    assert out["data.train_data_path"] == str(local / "train.jsonl")
    assert out["data.eval_data_path"] == str(local / "test.jsonl")
    assert out["evaluate_every_n_steps"] == 10  # 20 optimizer steps, 2 a rollout step
    assert (out["data.eval.k"], out["data.eval.temperature"], out["data.eval.batch_size"]) == (4, 0.8, 2)
    assert "data.eval_data_path" not in converted(dataset_name=str(local))  # TRL's eval_strategy: no
    hub = converted(dataset_name="openai/gsm8k", dataset_config="main", eval_strategy="epoch", num_generations_eval=2)
    assert hub["data.train_data_path"] == "hf://openai/gsm8k?config=main&split=train"
    assert hub["data.eval_data_path"] == "hf://openai/gsm8k?config=main&split=test" and hub["data.eval.k"] == 2
    shards = tmp_path / "shards"
    (shards / "data").mkdir(parents=True)
    for name in ("train-00000-of-00002.parquet", "train-00001-of-00002.parquet", "test-00000-of-00001.parquet"):
        (shards / "data" / name).write_bytes(b"")
    assert converted(dataset_name=str(shards))["data.train_data_path"] == f"{shards}/**/train-*.parquet"
    assert "split 'validation'" in skipped(dataset_name=str(local), dataset_train_split="validation")[
        "dataset_train_split"]


def test_logging_and_backends():
    out = converted(report_to=["wandb"], run_name="r1", log_completions=True, num_completions_to_print=4,
                    log_unique_prompts=True, disable_tqdm=True)
    assert out["trainer.logger"] == {"class_path": "lightning.pytorch.loggers.WandbLogger", "init_args": {"name": "r1"}}
    assert "samples.every_n_steps" not in out and out["samples.num_samples"] == 4
    assert out["samples.unique_prompts"] is True and out["trainer.enable_progress_bar"] is False
    assert converted()["samples.every_n_steps"] == 0  # TRL logs no completions by default
    assert "trainer.logger" not in converted(report_to="none")
    assert "comet_ml" in skipped(report_to="comet_ml")["report_to"]
    assert not any(k.startswith("model.rollout_correction") for k in converted())  # vLLM's correction, no vLLM
    out = converted(use_vllm=True, vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=2.5,
                    vllm_importance_sampling_clip_min=0.5)
    assert (out["model.rollout_correction.mode"], out["model.rollout_correction.cap"],
            out["model.rollout_correction.min"]) == ("token_mask", 2.5, 0.5)
    assert "data.rollout" in skipped(use_vllm=True)["use_vllm"]


def test_only_values_that_matter_are_listed_as_not_converted():
    reasons = skipped(push_to_hub=False, logging_steps=10, ddp_timeout="1800", report_to="none",
                      logging_first_step=True, hub_model_id="me/model", trust_remote_code=True)
    # the others are TRL's defaults
    assert set(reasons) == {"logging_first_step", "hub_model_id", "trust_remote_code"}


def test_each_conversion_writes_only_the_keys_the_page_gives_it(tmp_path):
    (tmp_path / "train.jsonl").write_text("{}\n")
    (tmp_path / "test.jsonl").write_text("{}\n")
    runs = [{}, dict(loss_type="cispo", epsilon_high=5.0), dict(loss_type="sapo"), dict(loss_type="vespo"),
            dict(dataset_name=str(tmp_path), eval_strategy="steps", eval_steps=5, use_peft=True,
                 lora_target_modules=["q_proj"], lora_modules_to_save=["lm_head"], use_vllm=True,
                 vllm_importance_sampling_mode="sequence_mask", vllm_importance_sampling_clip_min=0.1,
                 model_init_kwargs={"attn_implementation": "eager"}, reward_funcs=["accuracy_reward"],
                 reward_weights=[2.0], report_to=["tensorboard", "mlflow"], run_name="x", use_cpu=True,
                 full_determinism=True, save_only_model=True, sync_ref_model=True, beta=0.1,
                 use_adaptive_entropy=True, max_tool_calling_iterations=2, warmup_steps=0.1, max_steps=50,
                 multi_objective_aggregation="normalize_then_sum")]
    defaults = {name: spec.default for name, spec in FIELDS.items()}
    for given in runs:
        run = TrlRun(given, defaults)
        for name, spec in FIELDS.items():
            if spec.convert is None:
                continue
            out = spec.convert(run[name], run)
            stray = [k for k in out if not any(k == key or k.startswith(key + ".") for key in spec.keys)]
            assert stray == [], (name, given)


# ------------------------------------------------------------------------------------------------ the command
def write(tmp_path: Path, text: str, name: str = "grpo_config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_unknown_field_is_one_line_naming_the_file_and_line(tmp_path, capsys):
    path = write(tmp_path, "num_generations: 8\nlerning_rate: 1e-6\n")
    assert main(["from-trl", str(path)]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith(f"rlflow: error: {path}:2: unknown field 'lerning_rate' (did you mean learning_rate")


@pytest.mark.parametrize(("text", "expected"), [
    ("learning_rate: fast\n", ":1: learning_rate: 'fast' is not a number"),
    ("num_generations: 2.5\n", "num_generations: 2.5 is not a whole number"),
    ("beta: null\n", "beta must be a float, got null"),
    ("- a\n- b\n", "not a mapping of TRL config fields"),
    ("a: [\n", "not valid YAML or JSON"),
])
def test_bad_files_and_values_are_one_line(tmp_path, capsys, text, expected):
    assert main(["from-trl", str(write(tmp_path, text))]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err


def test_output_is_yaml_with_the_values_not_converted_on_top(tmp_path, capsys):
    path = write(tmp_path, json.dumps({"model_name_or_path": "m", "logging_steps": 1, "push_to_hub": True,
                                       "num_generations": 4}), "grpo_config.json")
    assert main(["from-trl", str(path)]) == 0
    text = capsys.readouterr().out
    head = [line for line in text.splitlines() if line.startswith("#")]
    assert "# not converted: logging_steps: rlflow logs every rollout step's metrics" in head
    assert any(line.startswith("# not converted: push_to_hub: ") for line in head)
    assert "# to set: data.train_data_path (the TRL config has no dataset_name)" in head
    config = yaml.safe_load(text)
    assert config["model"]["model_path"] == "m" and config["data"]["prompt_repeat_k"] == 4
    assert list(config)[:2] == ["seed_everything", "trainer"]


def test_config_command_needs_no_lightning_or_torch(tmp_path):
    path = write(tmp_path, "model_name_or_path: m\n")
    code = ("import sys; from rlflow.entry import main; code = main(['config', 'from-trl', sys.argv[1]]); "
            "assert not {'torch', 'lightning', 'trl'} & set(sys.modules), sorted(sys.modules); sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", code, str(path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert "model_path: m" in done.stdout
    helped = subprocess.run([sys.executable, "-m", "rlflow", "config", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0 and "from-trl" in helped.stdout


LOSS_FIELDS = dict(epsilon=0.3, epsilon_high=5.0, delta=7.0, beta=0.1, use_bias_correction_kl=False,
                   importance_sampling_level="token", mask_truncated_completions=True, top_entropy_quantile=0.2,
                   off_policy_mask_threshold=0.5, entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=2.0,
                   entropy_coef_min=0.001, entropy_coef_max=0.1, entropy_coef_delta=0.001, sapo_temperature_pos=0.9,
                   sapo_temperature_neg=1.2, vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5,
                   vespo_lambda_neg=1.5)


@pytest.mark.parametrize("loss", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
def test_every_loss_takes_the_options_its_conversion_gives(loss):
    from rlflow import registry

    level = "sequence" if loss == "luspo" else "token"  # TRL refuses luspo at the token level
    spec = convert({**LOSS_FIELDS, "loss_type": loss, "importance_sampling_level": level}).config["model"]["loss"]
    built = registry.build("rlflow.losses", spec)
    assert type(built).__name__.lower().startswith(loss.replace("_", ""))
    assert (built.kl_coef, built.entropy_coef, built.off_policy_mask_threshold) == (0.1, 0.01, 0.5)
    assert built.epsilon_high == (4.0 if loss == "cispo" else 5.0)


def test_a_converted_config_is_a_valid_rlflow_fit_config(tmp_path, capsys):
    """Every key the conversion writes is one ``rlflow fit`` takes, with a value of its type (``--print_config``
    parses and checks the whole config without loading anything)."""
    from rlflow.cli import cli_main

    (tmp_path / "train.jsonl").write_text("{}\n")
    (tmp_path / "test.jsonl").write_text("{}\n")
    given = dict(model_name_or_path="Qwen/Qwen3-0.6B", dataset_name=str(tmp_path), **LOSS_FIELDS,
                 eval_strategy="steps", eval_steps=5, num_generations_eval=2, use_peft=True,
                 lora_target_modules=["q_proj"], use_rslora=True, use_vllm=True, vllm_importance_sampling_clip_min=0.1,
                 reward_model_name_or_path="org/rm", reward_funcs=["accuracy_reward", "get_soft_overlong_punishment"],
                 reward_weights=[1.0, 0.5, 0.2], report_to=["wandb"], run_name="x", use_cpu=True, sync_ref_model=True,
                 max_tool_calling_iterations=2, warmup_steps=0.1, max_steps=50, save_total_limit=3,
                 save_only_model=True, disable_tqdm=True, min_p=0.05, chat_template_kwargs={"enable_thinking": False},
                 router_aux_loss_coef=0.001, scale_rewards="batch", output_dir=str(tmp_path / "out"))
    path = write(tmp_path, from_trl(str(write(tmp_path, yaml.safe_dump(given)))), "rlflow.yaml")
    with pytest.raises(SystemExit) as done:
        cli_main(["fit", "--config", str(path), "--print_config"])
    assert done.value.code in (0, None)
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["model"]["loss"]["class_path"].endswith("DAPOLoss")
    assert resolved["model"]["loss"]["init_args"]["delta"] == 7.0
    assert resolved["model"]["lora"]["options"] == {"use_rslora": True}
    assert resolved["data"]["judging"]["weights"] == {"rm": 1.0, "accuracy_reward": 0.5,
                                                      "soft_overlong_punishment_reward": 0.2}
    assert resolved["model"]["rollout_correction"] == {"mode": "sequence_mask", "cap": 3.0, "min": 0.1}
    assert resolved["evaluate_every_n_steps"] == 5 and resolved["data"]["eval"]["k"] == 2


def test_batches_trl_refuses_stop_the_conversion_naming_file_and_line(tmp_path, capsys):
    path = write(tmp_path, "model_name_or_path: m\nnum_generations: 3\nper_device_train_batch_size: 8\n")
    assert main(["from-trl", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip() == (f"rlflow: error: {path}:2: the generation batch of 8 completions is not a "
                                    "multiple of num_generations=3, which TRL refuses")
