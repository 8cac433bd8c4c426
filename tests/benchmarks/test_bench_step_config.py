"""benchmarks/bench_step.py's ``--config``: TRL mirrors the settings a shipped config sets, at their grouped keys
(``data.sampling.max_tokens``, ``model.optim.lr``, ``model.loss.init_args.epsilon_high``, ...) as at the flat keys
of older configs."""

from __future__ import annotations

from benchmarks.bench_step import config_settings


def test_grouped_keys_are_read(tmp_path):
    config = tmp_path / "grouped.yaml"
    config.write_text(
        "model:\n  model_path: m\n  loss: {class_path: bnpo, init_args: {epsilon_low: 0.2, epsilon_high: 0.28, "
        "kl_coef: 0.0}}\n  optim: {lr: 1.0e-6, warmup_steps: 2}\n  update: {micro_batch_size: 16}\n"
        "data:\n  train_data_path: d.jsonl\n  global_batch_size: 4\n  prompt_repeat_k: 4\n"
        "  sampling: {max_tokens: 48, temperature: 0.9}\n")
    assert config_settings(str(config)) == {
        "prompts": 4, "group": 4, "max_tokens": 48, "temperature": 0.9, "lr": 1e-6, "warmup_steps": 2,
        "loss": "bnpo", "epsilon": 0.2, "epsilon_high": 0.28, "kl_coef": 0.0, "micro_batch": 16, "model": "m",
        "data": "d.jsonl"}


def test_flat_keys_of_older_configs_are_read(tmp_path):
    config = tmp_path / "flat.yaml"
    config.write_text("model: {model_path: m, lr: 1.0e-5, loss: grpo, micro_batch_size: 8}\n"
                      "data: {max_tokens: 32, temperature: 1.0, global_batch_size: 2}\n")
    assert config_settings(str(config)) == {"prompts": 2, "max_tokens": 32, "temperature": 1.0, "lr": 1e-5,
                                            "loss": "grpo", "micro_batch": 8, "model": "m"}
