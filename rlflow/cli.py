"""Lightning's CLI behind ``rlflow fit`` and ``rlflow validate`` (``rlflow.entry`` is the console script).

``rlflow fit --config a.yaml [--config b.yaml] [--model.lr 1e-6]`` builds a :class:`GRPOModule`, a
:class:`RolloutDataModule` and a ``Trainer`` from jsonargparse configs (``--print_config`` shows the resolved
one). The tokenizer, temperature and completion budget are linked from one place to where they are needed.

rlflow adds to Lightning's CLI: ``--checkpoint.*`` (an atomic ``ModelCheckpoint`` writing ``last.ckpt`` every
step, so ``--ckpt_path last`` resumes after a kill), ``--evaluate_every_n_steps N`` (Lightning's
``val_check_interval`` counted in rollout steps across epochs), ``--summary.*``, ``--rollout_progress.*``,
``--samples.*`` and ``--trajectories.*`` (see :mod:`rlflow.callbacks`), the logger short names ``--trainer.logger
wandb|csv|tensorboard``, and the full resolved config logged to every logger. Errors a user can fix (bad data, a missing model, a full
disk, a diverged run) end the command with one ``rlflow: error:`` line instead of a traceback.
"""

from __future__ import annotations

import os
import sys

from lightning.pytorch.cli import LightningCLI

from rlflow.callbacks import LoggerSaveConfigCallback, RolloutProgressBar, SampleTable, StepSummary, TrajectoryWriter
from rlflow.checkpointing import CheckpointDiskFullError, RLFlowCheckpoint
from rlflow.data.datamodule import RolloutDataModule
from rlflow.distributed import resolve_strategy_alias
from rlflow.module import GRPOModule

TRAINER_DEFAULTS = {
    "log_every_n_steps": 1,
    "num_sanity_val_steps": 0,
    "use_distributed_sampler": False,
    "enable_model_summary": False,
}
LOGGER_ALIASES = {
    "wandb": "lightning.pytorch.loggers.WandbLogger",
    "csv": "lightning.pytorch.loggers.CSVLogger",
    "tensorboard": "lightning.pytorch.loggers.TensorBoardLogger",
}


def expand_logger_aliases(args: list[str]) -> list[str]:
    """``--trainer.logger wandb`` (or ``=wandb``, ``csv``, ``tensorboard``) -> the logger's class path."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        if arg == "--trainer.logger" and i + 1 < len(args) and args[i + 1].lower() in LOGGER_ALIASES:
            out += [arg, LOGGER_ALIASES[args[i + 1].lower()]]
            i += 2
            continue
        if arg.startswith("--trainer.logger=") and arg.split("=", 1)[1].lower() in LOGGER_ALIASES:
            arg = "--trainer.logger=" + LOGGER_ALIASES[arg.split("=", 1)[1].lower()]
        out.append(arg)
        i += 1
    return out


class RLFlowCLI(LightningCLI):
    """LightningCLI with rlflow's argument links and defaults."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.model_path", "data.tokenizer_path")
        parser.link_arguments("data.temperature", "model.temperature")
        parser.link_arguments("data.max_tokens", "model.max_tokens")
        parser.add_lightning_class_args(RLFlowCheckpoint, "checkpoint")
        parser.add_lightning_class_args(StepSummary, "summary")
        parser.add_lightning_class_args(RolloutProgressBar, "rollout_progress")
        parser.add_lightning_class_args(SampleTable, "samples")
        parser.add_lightning_class_args(TrajectoryWriter, "trajectories")
        parser.add_argument(
            "--evaluate_every_n_steps", type=int | None, default=None,
            help="Evaluate on data.eval_data_path every this many rollout steps (default: once per epoch).",
        )

    def _instantiate_trainer(self, config, callbacks):
        if config.get("enable_checkpointing") is False:  # --trainer.enable_checkpointing=false drops rlflow's too
            callbacks = [c for c in callbacks if not isinstance(c, RLFlowCheckpoint)]
        return super()._instantiate_trainer(config, callbacks)

    def parse_arguments(self, parser, args) -> None:
        if args is None:  # the console script: read sys.argv ourselves to expand the logger short names
            self.config = parser.parse_args(expand_logger_aliases(sys.argv[1:]))
            return
        super().parse_arguments(parser, expand_logger_aliases(list(args)) if isinstance(args, list) else args)

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        every = config.get("evaluate_every_n_steps")
        trainer = config.get("trainer")
        if trainer is None:
            return
        if every is not None:
            if every < 1:
                raise ValueError(f"evaluate_every_n_steps must be >= 1, got {every}")
            if not config["data"].get("eval_data_path"):
                raise ValueError(f"evaluate_every_n_steps={every} needs an eval set: set data.eval_data_path")
            trainer["val_check_interval"] = every  # counted in training batches = rollout steps...
            trainer["check_val_every_n_epoch"] = None  # ...across epoch boundaries
        logger = trainer.get("logger")
        if getattr(logger, "class_path", None) == LOGGER_ALIASES["wandb"]:
            init = logger.init_args
            if init.get("save_dir") in (None, "."):  # keep W&B files (and trajectories) under the run's root dir
                init["save_dir"] = trainer.get("default_root_dir") or os.getcwd()
            if init.get("project") is None:
                init["project"] = "rlflow"

    def instantiate_trainer(self, **kwargs):
        """Map rlflow's strategy aliases (``trainer.strategy: fsdp`` -> FSDP2, see :mod:`rlflow.distributed`)."""
        strategy = kwargs.get("strategy", self._get(self.config_init, "trainer", default={}).get("strategy"))
        if resolve_strategy_alias(strategy) is not strategy:
            kwargs["strategy"] = resolve_strategy_alias(strategy)
        return super().instantiate_trainer(**kwargs)


def cli_main(args: list[str] | None = None, run: bool = True, cli_class: type[RLFlowCLI] | None = None) -> RLFlowCLI:
    """Build (and with ``run``, run) the CLI; ``cli_class`` lets a tool such as ``rlflow data check`` reuse it."""
    return (cli_class or RLFlowCLI)(
        GRPOModule,
        RolloutDataModule,
        args=args,
        run=run,
        seed_everything_default=0,
        trainer_defaults=dict(TRAINER_DEFAULTS),
        save_config_callback=LoggerSaveConfigCallback,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )


def main(argv: list[str] | None = None) -> int:
    """Lightning's subcommands (``fit``, ``validate``, ...); ``rlflow.entry`` dispatches the others first."""
    try:
        cli_main(argv)
    except USER_ERRORS as exc:
        if os.environ.get("RLFLOW_TRACEBACK"):
            raise
        print(f"rlflow: error: {exc}\n(set RLFLOW_TRACEBACK=1 for the full traceback)", file=sys.stderr)
        return 1
    return 0


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "fix your input", not "rlflow has a bug": printed as one line by ``main``."""
    from rlflow.data.dataset import DataError
    from rlflow.module import NonFiniteLossError
    from rlflow.registry import PluginError

    return (DataError, PluginError, NonFiniteLossError, CheckpointDiskFullError, FileNotFoundError)


USER_ERRORS = _user_errors()


if __name__ == "__main__":
    from rlflow.entry import main as entry_main

    sys.exit(entry_main())
