"""``GRPOModule``'s grouped settings (rlflow/training/settings.py): each group checks its own values, naming the
full key; a group is a dataclass or a mapping of its fields; checkpoints hold them as plain data; ``--help`` shows
each field's documentation."""

from __future__ import annotations

import pytest

from rlflow.config_error import ConfigError
from rlflow.training.settings import (
    ModuleSettings,
    OptimSettings,
    PolicySettings,
    ReferenceSettings,
    RolloutCorrectionSettings,
    UpdateSettings,
    grouped_hparams,
)


@pytest.mark.parametrize(("build", "message"), [
    (lambda: OptimSettings(lr=0), "model.optim.lr must be > 0.0, got 0"),
    (lambda: OptimSettings(optimizer="sgd"), "model.optim.optimizer must be one of adamw, adamw_bf16_sr"),
    (lambda: OptimSettings(betas=(0.9, 1.0)), r"model.optim.betas must be two numbers in \[0, 1\)"),
    (lambda: OptimSettings(lr_schedule="step"), "model.optim.lr_schedule must be one of constant, linear, cosine"),
    (lambda: OptimSettings(max_grad_norm=0.0), "model.optim.max_grad_norm must be > 0.0"),
    (lambda: UpdateSettings(micro_batch_size=0), "model.update.micro_batch_size must be an integer >= 1, got 0"),
    (lambda: UpdateSettings(optimizer_steps=1.5), "model.update.optimizer_steps must be an integer >= 1"),
    (lambda: ReferenceSettings(sync_steps=-1), "model.reference.sync_steps must be an integer >= 0"),
    (lambda: ReferenceSettings(mixup_alpha=0.0), r"model.reference.mixup_alpha must be in \(0.0, 1.0\]"),
    (lambda: RolloutCorrectionSettings(mode="tis"), "model.rollout_correction.mode must be one of token_truncate"),
    (lambda: RolloutCorrectionSettings(cap=0), "model.rollout_correction.cap must be > 0.0"),
    (lambda: RolloutCorrectionSettings(mode="sequence_mask", cap=2.0, min=3.0),
     r"model.rollout_correction.min must be in \[0, model.rollout_correction.cap=2.0\)"),
    (lambda: PolicySettings(dtype="int8"), "model.policy.dtype must be one of float32, bfloat16, float16"),
])
def test_each_group_checks_its_values_naming_the_full_key(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


def test_a_group_is_a_dataclass_a_mapping_or_none():
    assert OptimSettings.coerce({"lr": 1e-4}) == OptimSettings(lr=1e-4)
    assert OptimSettings.coerce(None) == OptimSettings()
    given = UpdateSettings(packing=False)
    assert UpdateSettings.coerce(given) is given
    with pytest.raises(ConfigError, match="model.optim has no option 'learning_rate'; its options are optimizer, lr"):
        OptimSettings.coerce({"learning_rate": 1e-4})
    with pytest.raises(ConfigError, match="model.update must be a mapping of UpdateSettings fields, got int"):
        UpdateSettings.coerce(3)


def test_sync_steps_need_a_kl_term_and_no_lora():
    ReferenceSettings(sync_steps=2).check_use(uses_reference=True, lora=False)
    ReferenceSettings().check_use(uses_reference=False, lora=True)  # 0: nothing to check
    with pytest.raises(ConfigError, match="set model.loss.init_args.kl_coef > 0 or model.reference.sync_steps=0"):
        ReferenceSettings(sync_steps=2).check_use(uses_reference=False, lora=False)
    with pytest.raises(ConfigError, match="model.reference.sync_steps=2 is not supported with model.lora"):
        ReferenceSettings(sync_steps=2).check_use(uses_reference=True, lora=True)


def test_module_settings_as_plain_data_and_former_flat_hparams_grouped():
    settings = ModuleSettings.of("m", lora={"r": 4}, optim={"lr": 2e-3}, update=UpdateSettings(packing=False))
    plain = settings.hparams()
    assert plain["optim"]["lr"] == 2e-3 and plain["update"]["packing"] is False and plain["lora"]["r"] == 4
    assert plain["policy"] == PolicySettings().as_dict() and plain["reference"]["path"] is None
    assert ModuleSettings.of("m", **{k: v for k, v in plain.items() if k != "lora"}, lora=plain["lora"]) == settings
    old = {"model_path": "m", "lr": 2e-3, "dtype": "bfloat16", "ref_model_path": "r", "rollout_is": "token_mask",
           "kl_coef": 0.1, "temperature": 0.7, "max_tokens": 12, "lora": None, "export_hf": False}
    assert grouped_hparams(old) == {"model_path": "m", "lora": None, "export_hf": False, "optim": {"lr": 2e-3},
                                    "policy": {"dtype": "bfloat16"}, "reference": {"path": "r"},
                                    "rollout_correction": {"mode": "token_mask"}}
    assert grouped_hparams(plain) == plain


def test_the_module_takes_groups_as_mappings_and_keeps_plain_hparams(tiny_model):
    from rlflow.losses.clipped import GRPOLoss
    from rlflow.training.module import GRPOModule

    module = GRPOModule(str(tiny_model), loss=GRPOLoss(kl_coef=0.01), optim={"lr": 3e-4, "betas": (0.8, 0.9)},
                        update=UpdateSettings(micro_batch_size=2), reference={"sync_steps": 2})
    assert module.settings.optim == OptimSettings(lr=3e-4, betas=(0.8, 0.9))
    assert module.settings.update.micro_batch_size == 2 and module.uses_reference
    assert module.hparams["optim"] == OptimSettings(lr=3e-4, betas=(0.8, 0.9)).as_dict()
    assert module.hparams["reference"] == {"path": None, "sync_steps": 2, "mixup_alpha": 0.6}
    assert all(isinstance(module.hparams[g], dict) for g in ("optim", "update", "reference", "policy"))
    assert not GRPOModule(str(tiny_model), loss="grpo").uses_reference  # the loss's kl_coef is the one switch
    with pytest.raises(ConfigError, match="model.reference.sync_steps=2 moves the KL reference"):
        GRPOModule(str(tiny_model), reference={"sync_steps": 2})
    with pytest.raises(ConfigError, match="model.policy.dtype must be one of"):
        GRPOModule(str(tiny_model), policy={"dtype": "fp8"})


def test_fit_help_documents_each_field(capsys):
    from rlflow.cli import cli_main

    with pytest.raises(SystemExit):
        cli_main(["fit", "--help"], run=False)
    out = capsys.readouterr().out
    assert "--model.optim.lr LR" in out and "Peak learning rate of AdamW." in out
    for key in ("--model.update.micro_batch_size", "--model.reference.sync_steps", "--model.rollout_correction.mode",
                "--model.policy.gradient_checkpointing", "--model.lora.help"):
        assert key in out, key
    assert "--model.temperature" not in out and "--model.kl_coef" not in out and "--model.lr " not in out


def test_only_help_reads_the_field_docstrings(monkeypatch, tiny_model, tiny_data, tmp_path):
    """Reading the settings classes' attribute docstrings parses their source; a run that prints no help skips it."""
    import docstring_parser.parser as docstring_parser

    from rlflow.cli import asks_for_help, cli_main
    from tests.helpers.fit import fit_args

    read = []
    original = docstring_parser.add_attribute_docstrings
    monkeypatch.setattr(docstring_parser, "add_attribute_docstrings",
                        lambda *a, **k: read.append(1) or original(*a, **k))
    cli = cli_main(fit_args(tiny_model, tiny_data, tmp_path, "--model.optim.lr=0.25", steps=1)[1:], run=False)
    assert cli.model.hparams["optim"]["lr"] == 0.25 and not read
    with pytest.raises(SystemExit):
        cli_main(["fit", "--help"], run=False)
    assert read
    for argv in (["fit", "-h"], ["fit", "--model.loss.help", "grpo"], ["fit", "--data.judging.judgers.help=gsm8k"],
                 ["fit", "--print_config", "--config", "c.yaml"], ["fit", "--print_config=comments"]):
        assert asks_for_help(argv), argv
    assert not asks_for_help(["fit", "--config", "help.yaml", "--trainer.max_steps=2"]) and not asks_for_help(None)


def test_only_the_requested_subcommands_parser_is_built(capsys):
    """``rlflow fit ...`` builds the fit parser alone; without a leading subcommand both of
    rlflow's (``fit``, ``validate``) are built and listed."""
    from lightning.pytorch.cli import LightningCLI

    from rlflow.cli import RLFlowCLI, main

    cli = RLFlowCLI.__new__(RLFlowCLI)
    for requested, built in (("fit", ["fit"]), ("validate", ["validate"]),
                             (None, ["fit", "validate"])):
        cli.requested = requested
        assert list(cli.subcommands()) == built
        assert all(cli.subcommands()[name] == LightningCLI.subcommands()[name] for name in built)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "{fit,validate}" in capsys.readouterr().out  # rlflow runs no test_step or predict
