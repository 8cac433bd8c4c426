"""Settings that moved into groups: an old flat key (``data.max_tokens``) is one error naming its new place.

:func:`check_argv` reads the command line and the YAML files it names before jsonargparse parses them, so a config
written for the flat layout fails with ``configs/x.yaml, line 12: data.max_tokens is now data.sampling.max_tokens``
instead of jsonargparse's list of every valid key.
"""

from __future__ import annotations

from typing import Any

from rlflow.config_error import ConfigError

#: ``{section: {old key: new key}}``; a new key in parentheses lives in another section.
MOVED: dict[str, dict[str, str]] = {
    "data": {
        **{key: f"sampling.{key}" for key in ("max_tokens", "temperature", "top_p", "top_k", "min_p",
                                              "repetition_penalty", "stop")},
        "judgers": "judging.judgers", "reward_weights": "judging.weights", "judger_timeout": "judging.timeout",
        "overlap_judging": "judging.overlap",
        "dynamic_sampling": "filtering.dynamic_sampling", "max_sampling_rounds": "filtering.max_rounds",
        "skip_solved": "filtering.skip_solved",
        "system_prompt": "prompts.system_prompt", "prompt_template": "prompts.template",
        "chat_template_kwargs": "prompts.chat_template_kwargs",
        "eval_temperature": "eval.temperature", "eval_batch_size": "eval.batch_size",
        "eval_pass_threshold": "eval.pass_threshold", "eval_k": "eval.k",
        "tools": "multiturn.tools", "tool_parser": "multiturn.parser", "tool_timeout": "multiturn.tool_timeout",
        "environment": "multiturn.environment", "max_turns": "multiturn.max_turns",
        **{key: f"pipeline.{key}" for key in ("max_staleness", "stale_policy", "generator_threads",
                                              "partial_rollouts", "partial_swap_step", "lend_cores",
                                              "split_rollout")},
    },
    "model": {
        **{key: f"optim.{key}" for key in ("lr", "optimizer", "weight_decay", "betas", "warmup_steps",
                                           "lr_schedule", "max_grad_norm")},
        **{key: f"loss.init_args.{key}" for key in ("epsilon_low", "epsilon_high", "kl_coef", "kl_type")},
        "ref_model_path": "reference.path", "ref_model_sync_steps": "reference.sync_steps",
        "ref_model_mixup_alpha": "reference.mixup_alpha",
        "rollout_is": "rollout_correction.mode", "rollout_is_cap": "rollout_correction.cap",
        "rollout_is_min": "rollout_correction.min",
        **{key: f"update.{key}" for key in ("optimizer_steps", "num_iterations", "micro_batch_size", "packing",
                                            "pack_max_length", "logprob_chunk_size",
                                            "max_consecutive_skipped_steps")},
        **{key: f"policy.{key}" for key in ("dtype", "attn_implementation", "gradient_checkpointing",
                                            "fast_rms_norm", "disable_dropout", "cast_lm_head_to_fp32",
                                            "router_aux_loss_coef", "freeze_vision_tower")},
        "temperature": "(data.sampling.temperature)", "max_tokens": "(data.sampling.max_tokens)",
    },
}


def new_place(section: str, key: str) -> str | None:
    """Where ``section.key`` lives now (a full dotted key), or None if it did not move."""
    moved = MOVED.get(section, {}).get(key)
    if moved is None:
        return None
    return moved[1:-1] if moved.startswith("(") else f"{section}.{moved}"


def message(section: str, key: str, where: str = "") -> str:
    """The one line for an old key: where it was found, and its new place."""
    new = new_place(section, key)
    return f"{where}{section}.{key} is now {new} (settings are grouped; see the guide's configuration reference)"


def check_argv(argv: list[str]) -> None:
    """Raise one ConfigError for the first old flat key on the command line or in a ``--config`` file."""
    for i, arg in enumerate(argv):
        if arg in ("--config", "-c") and i + 1 < len(argv):
            check_file(argv[i + 1])
        elif arg.startswith("--config="):
            check_file(arg.split("=", 1)[1])
        elif arg.startswith(("--data.", "--model.")):
            section, _, rest = arg[2:].split("=", 1)[0].partition(".")
            key = rest.split(".", 1)[0]
            if new_place(section, key) is not None:
                raise ConfigError(message(section, key, "command line: "))


def check_file(path: str) -> None:
    """Raise one ConfigError naming the file, line and key of the first old flat key in the YAML at ``path``."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            root = yaml.compose(f)
    except (OSError, yaml.YAMLError):
        return  # jsonargparse reports a file it cannot read, in its own words
    top = dict((k.value, v) for k, v in _mapping_items(root))
    if "fit" in top:  # a config of `rlflow` with the subcommand level
        top = {**top, **dict((k.value, v) for k, v in _mapping_items(top["fit"]))}
    for section in ("data", "model"):
        for key_node, _ in _mapping_items(top.get(section)):
            if new_place(section, key_node.value) is not None:
                raise ConfigError(message(section, key_node.value, f"{path}, line {key_node.start_mark.line + 1}: "))


def _mapping_items(node: Any) -> list[tuple[Any, Any]]:
    import yaml

    return list(node.value) if isinstance(node, yaml.MappingNode) else []
