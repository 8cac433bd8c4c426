"""Lightning's CLI behind ``rlflow fit`` and ``rlflow validate`` (``rlflow.entry`` is the console script).

``rlflow fit --config a.yaml [--config b.yaml] [--model.optim.lr 1e-6]`` builds a :class:`GRPOModule`, a
:class:`RolloutDataModule` and a ``Trainer`` from jsonargparse configs (``--print_config`` shows the resolved
one). Settings come in typed groups (``data.sampling``, ``model.optim``, ...) whose field docstrings ``--help``
shows; a key of the old flat layout is one error naming its new place (:mod:`rlflow.config_moves`).

rlflow adds to Lightning's CLI: ``--checkpoint.*`` (an atomic ``ModelCheckpoint`` writing ``last.ckpt`` every step,
so ``--ckpt_path last`` resumes this run after a kill, see :mod:`rlflow.training.resume`), a stop at the next step
boundary with a checkpoint on SIGTERM or SIGINT (exit code 143 or 130, :class:`GracefulStop`), a check that the
log and checkpoint directories are writable before anything loads, ``--evaluate_every_n_steps N``
(Lightning's ``val_check_interval`` counted in rollout steps across epochs), ``--summary.*``, ``--no_signal.*``,
``--rollout_progress.*``, ``--samples.*`` and ``--trajectories.*`` (see :mod:`rlflow.training.callbacks`), the
logger short names ``--trainer.logger wandb|csv|tensorboard``, and the full resolved config logged to every
logger. Errors a user can fix (an invalid value, bad data, a missing model, an unwritable directory, a full disk, a
diverged run) end the command with one ``rlflow: error:`` line instead of a traceback.

``RLFLOW_STOP_TIMEOUT`` (seconds, default 300; 0: no bound): how long a signalled run may take to reach the end of
its rollout step before it stops without finishing it.

Plugin arguments (``model.loss``, ``data.rollout``, ``data.advantage``, ``data.judging.judgers``) are typed, so
``class_path``/``init_args`` are validated and ``--model.loss.help grpo`` documents a plugin; registry short
names work as ``class_path`` (see :mod:`rlflow.registry`). ``data.sampling.max_tokens`` fills the ``max_tokens``
of the loss and the judgers that take one and leave it unset.
"""

from __future__ import annotations

import errno
import inspect
import os
import re
import shutil
import signal
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ArgumentError, Namespace, set_parsing_settings
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from rlflow import registry
from rlflow.commands import LIGHTNING_COMMANDS
from rlflow.config_checks import check_batch_split
from rlflow.config_error import ConfigError
from rlflow.config_moves import check_argv
from rlflow.config_parse_errors import parse_error_line, parser_keys, raise_errors
from rlflow.data.datamodule import RolloutDataModule
from rlflow.models.model_path import check_model_path
from rlflow.rollout.pipeline import check_partial_ranks
from rlflow.training.callbacks import (
    LoggerSaveConfigCallback,
    NoSignalWarning,
    RolloutProgressBar,
    SampleTable,
    StepSummary,
    TrajectoryWriter,
    default_progress_bar,
)
from rlflow.training.checkpointing import (
    STOP_TIMEOUT,
    DiskFullError,
    GracefulStop,
    RLFlowCheckpoint,
    StoppedBySignal,
    check_writable,
    disk_full,
)
from rlflow.training.distributed import resolve_strategy_alias
from rlflow.training.module import GRPOModule
from rlflow.training.resume import checkpoint_dir, choose_checkpoint, version_named
from rlflow.training.safe_load import SafeCheckpointIO
from rlflow.training.trainer import RLFlowTrainer

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
    """``--trainer.logger wandb`` (or ``=wandb``, ``csv``, ``tensorboard``) -> the logger's class path. ``csv`` and
    ``tensorboard`` also get ``save_dir .`` (their constructors have no default; a later ``--trainer.logger.save_dir``
    wins), which :meth:`RLFlowCLI.before_instantiate_classes` reads as ``trainer.default_root_dir``."""
    out, i = [], 0
    while i < len(args):
        arg, alias = args[i], None
        if arg == "--trainer.logger" and i + 1 < len(args) and args[i + 1].lower() in LOGGER_ALIASES:
            alias, i = args[i + 1].lower(), i + 1
        elif arg.startswith("--trainer.logger=") and arg.split("=", 1)[1].lower() in LOGGER_ALIASES:
            alias = arg.split("=", 1)[1].lower()
        if alias is None:
            out.append(arg)
        else:
            out.append(f"--trainer.logger={LOGGER_ALIASES[alias]}")
            if alias != "wandb":
                out.append("--trainer.logger.save_dir=.")
        i += 1
    return out


def asks_for_help(argv: Any) -> bool:
    """Whether the command line prints help text (``-h``, ``--help``, ``--model.loss.help grpo``,
    ``--print_config``). Only then are the classes' field docstrings read: reading them parses the source of every
    settings class once per subcommand."""
    if not isinstance(argv, list):
        return False
    keys = [str(a).split("=", 1)[0] for a in argv]
    return any(k in ("-h", "--help") or k.endswith(".help") or k.startswith("--print_config") for k in keys)


def is_class_spec(value: Any) -> bool:
    """Whether a parsed config value is a ``class_path``/``init_args`` spec (not a plain string)."""
    return isinstance(value, Namespace) and isinstance(value.get("class_path"), str)


def plugin_specs(value: Any) -> list[Namespace]:
    """The class specs in a parsed ``data.judging.judgers`` value (a mapping of specs or lists of specs)."""
    if is_class_spec(value):
        return [value]
    if isinstance(value, (list, tuple)):
        return [spec for item in value for spec in plugin_specs(item)]
    if isinstance(value, (dict, Namespace)):
        return [spec for item in value.values() for spec in plugin_specs(item)]
    return []


def _init_args(spec: Namespace) -> Namespace:
    if spec.get("init_args") is None:
        spec["init_args"] = Namespace()
    return spec["init_args"]


def apply_plugin_settings(config: Namespace) -> None:
    """Put ``data.sampling.max_tokens`` into the ``init_args`` of the plugins that take ``max_tokens`` and leave it
    unset: the loss given as ``class_path``/``init_args`` (its normaliser outside a training step) and the judgers
    (the overlong-length judger, say)."""
    model, data = config.get("model"), config.get("data")
    if data is None:
        return
    max_tokens = (data.get("sampling") or Namespace()).get("max_tokens")
    specs = plugin_specs((data.get("judging") or Namespace()).get("judgers"))
    if model is not None and is_class_spec(model.get("loss")):
        specs.append(model["loss"])
    for spec in specs:
        cls = registry.import_path(spec["class_path"])
        registry.apply_settings(cls, _init_args(spec), {"max_tokens": max_tokens})


def check_config(config: Namespace) -> None:
    """Checks before either class is instantiated, so each error names the key the user set (``model.model_path``,
    not the linked ``data.tokenizer_path``), and a wrong backend name fails before any model loads."""
    model, data = config.get("model"), config.get("data")
    every_n_epochs = (config.get("trainer") or Namespace()).get("check_val_every_n_epoch")
    if isinstance(every_n_epochs, int) and every_n_epochs < 1:  # Lightning divides by it
        raise ConfigError(f"trainer.check_val_every_n_epoch must be >= 1 (or null), got {every_n_epochs}")
    if model is not None and isinstance(model.get("model_path"), str):
        check_model_path(model["model_path"], "model.model_path")
    if data is not None:
        rollout = data.get("rollout")
        if isinstance(rollout, str) and rollout != "auto":  # built after the policy loads: check its name now
            try:
                registry.check_spec(ROLLOUT_GROUP, rollout)
            except registry.PluginError as exc:
                raise registry.PluginError(f"data.rollout: {exc}") from exc


class RLFlowCLI(LightningCLI):
    """LightningCLI with rlflow's argument links and defaults."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        registry.install_jsonargparse_resolver()  # class_path: <registry short name>, see rlflow.registry
        # the settings groups' field docstrings (litgpt's style) are what --help shows for each option
        argv = sys.argv[1:] if kwargs.get("args") is None else kwargs["args"]
        set_parsing_settings(docstring_parse_attribute_docstrings=asks_for_help(argv))
        self.requested = argv[0] if isinstance(argv, list) and argv and argv[0] in LIGHTNING_COMMANDS else None
        super().__init__(*args, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:  # type: ignore[override]
        """Lightning's ``fit`` and ``validate`` (:data:`rlflow.commands.LIGHTNING_COMMANDS`), or only the one the
        command line starts with (``rlflow fit ...``): each subcommand's parser takes every settings class, and the
        others would be built for nothing."""
        every = {name: skip for name, skip in LightningCLI.subcommands().items() if name in LIGHTNING_COMMANDS}
        return every if self.requested is None else {self.requested: every[self.requested]}

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.model_path", "data.tokenizer_path")
        parser.add_lightning_class_args(RLFlowCheckpoint, "checkpoint")
        parser.add_lightning_class_args(StepSummary, "summary")
        parser.add_lightning_class_args(NoSignalWarning, "no_signal")
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
        configured = config.get("callbacks") or []
        configured = [*(configured if isinstance(configured, list) else [configured]), *callbacks]
        bar = default_progress_bar(configured, config.get("enable_progress_bar"))
        stop = None if any(isinstance(c, GracefulStop) for c in configured) else GracefulStop(stop_timeout())
        trainer = super()._instantiate_trainer(config, [*callbacks, *(c for c in (bar, stop) if c is not None)])
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:  # RLFlowCheckpoint puts the atomic one
            trainer.strategy.checkpoint_io = SafeCheckpointIO()  # reads never unpickle, with or without it
        return trainer

    def _parse_ckpt_path(self) -> None:
        """Lightning replaces the ``model`` settings with a checkpoint file's hyper-parameters; ``fit`` keeps
        this run's and compares them with the checkpoint's (:func:`rlflow.training.resume.choose_checkpoint`), so
        that a changed learning rate is used and a changed model refused."""
        if self.config.get("subcommand") != "fit":
            super()._parse_ckpt_path()

    def _prepare_subcommand_kwargs(self, subcommand: str) -> dict[str, Any]:
        kwargs = super()._prepare_subcommand_kwargs(subcommand)
        if subcommand == "fit":
            kwargs["ckpt_path"] = self.prepare_fit(kwargs.get("ckpt_path"))
        return kwargs

    def prepare_fit(self, ckpt_path: Any) -> Any:
        """Before ``fit`` loads anything or starts its ranks: the settings refused with several ranks, the log and
        checkpoint directories take files (one line naming the one that does not), the configuration goes into the
        checkpoints, and ``--ckpt_path`` becomes the checkpoint of this run it resumes
        (:func:`rlflow.training.resume.choose_checkpoint`)."""
        named = version_named(self.trainer)  # before the checks below settle an unnamed version
        pipelining = getattr(self.datamodule, "pipeline_settings", None)
        if pipelining is not None and pipelining.partial_rollouts:
            check_partial_ranks(self.trainer.world_size)  # before any rank starts
        update = getattr(getattr(self.model, "settings", None), "update", None)
        if update is not None and hasattr(self.datamodule, "global_batch_size"):
            check_batch_split(self.datamodule.global_batch_size, self.datamodule.prompt_repeat_k,
                              update.optimizer_steps, self.trainer.world_size)
        for directory, key in written_dirs(self.trainer):
            check_writable(directory, key)
        config = yaml.safe_load(self._parser(self.subcommand).dump(self.config[self.subcommand], skip_none=False))
        self.model.resume.config = config
        resumed = choose_checkpoint(ckpt_path, self.trainer, config, named)
        inputs = [getattr(p, "absolute", str(p)) for p in self.config[self.subcommand].get("config") or []]
        check_run_files(self.trainer, inputs, resumed is not None)
        return resumed

    def _run_subcommand(self, subcommand: str) -> None:
        """Lightning's stop on a signal (``SIGTERMException``, exit code 0) as :class:`StoppedBySignal`; a full
        disk met outside a checkpoint write (logs) as one :class:`DiskFullError` line."""
        try:
            super()._run_subcommand(subcommand)
        except SIGTERMException:
            stop = next((c for c in self.trainer.callbacks if isinstance(c, GracefulStop)), None)
            if stop is None or stop.signum is None:
                raise
            raise stop.stopped(self.trainer) from None
        except SystemExit as exc:  # Lightning's exit(1) after a Ctrl-C outside training (GracefulStop's handlers)
            if exc.code != 1 or not self.trainer.interrupted:
                raise
            signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning left it ignored
            stopped = StoppedBySignal(signal.SIGINT, self.trainer.global_step, None, False)
            stopped.args = (f"stopped by SIGINT outside a rollout step (exit code {stopped.exit_code})",)
            raise stopped from None
        except Exception as exc:
            if isinstance(exc, DiskFullError) or not disk_full(exc):
                raise
            where = str(getattr(exc, "filename", None) or self.trainer.log_dir or self.trainer.default_root_dir)
            folder = where if os.path.isdir(where) else os.path.dirname(where) or "."
            free = f"{shutil.disk_usage(folder).free / 2**20:.1f} MiB free in {folder}" if os.path.isdir(folder) \
                else "the disk is full"
            raise DiskFullError(errno.ENOSPC, f"no space left on the device while writing {where} ({free}). The "
                                "checkpoints already written are intact. Free disk space, then continue with "
                                "--ckpt_path last") from exc

    def parse_arguments(self, parser, args) -> None:
        argv = sys.argv[1:] if args is None else args
        if isinstance(argv, list):
            check_argv(argv)  # a flat key of the old layout: one line naming its new place
            function_judger_help(argv)
        raise_errors(parser)  # an unknown key or a bad value: one line (below), not jsonargparse's usage text
        try:
            if args is None:  # the console script: read sys.argv ourselves to expand the logger short names
                self.config = parser.parse_args(expand_logger_aliases(sys.argv[1:]))
                return
            super().parse_arguments(parser, expand_logger_aliases(list(args)) if isinstance(args, list) else args)
        except ArgumentError as exc:
            named = argv if isinstance(argv, list) else []
            line = parse_error_line(str(exc), named, parser_keys(parser))
            if line.endswith("model.model_path: expected str, got None"):  # no config given (rlflow validate --ckpt)
                line += "; pass the run's --config (its config.yaml) or --model.model_path"
            raise ConfigError(line) from None

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        check_config(config)
        data = config.get("data")
        if self.subcommand == "validate" and data is not None and not data.get("eval_data_path"):
            raise ConfigError("rlflow validate evaluates on data.eval_data_path, which is not set; give it the "
                              "prompts to evaluate on")  # before any model loads
        apply_plugin_settings(config)
        every = config.get("evaluate_every_n_steps")
        trainer = config.get("trainer")
        if trainer is None:
            return
        if every is not None:
            if every < 1:
                raise ConfigError(f"evaluate_every_n_steps must be >= 1, got {every}")
            if not config["data"].get("eval_data_path"):
                raise ConfigError(f"evaluate_every_n_steps={every} needs an eval set: set data.eval_data_path, or "
                                  "--evaluate_every_n_steps null to train without evaluation")
            trainer["val_check_interval"] = every  # counted in training batches = rollout steps...
            trainer["check_val_every_n_epoch"] = None  # ...across epoch boundaries
        logger = trainer.get("logger")
        if getattr(logger, "class_path", None) in (LOGGER_ALIASES["csv"], LOGGER_ALIASES["tensorboard"]):
            if logger.init_args.get("save_dir") == ".":  # the short names' (expand_logger_aliases)
                logger.init_args["save_dir"] = trainer.get("default_root_dir") or os.getcwd()
        if getattr(logger, "class_path", None) == LOGGER_ALIASES["wandb"]:
            init = logger.init_args
            if init.get("save_dir") in (None, "."):  # keep W&B files (and trajectories) under the run's root dir
                init["save_dir"] = trainer.get("default_root_dir") or os.getcwd()
            if init.get("project") is None:
                init["project"] = "rlflow"

    def instantiate_trainer(self, **kwargs):
        """Map rlflow's strategy aliases (``trainer.strategy: fsdp`` -> FSDP2, see
        :mod:`rlflow.training.distributed`)."""
        strategy = kwargs.get("strategy", self._get(self.config_init, "trainer", default={}).get("strategy"))
        if resolve_strategy_alias(strategy) is not strategy:
            kwargs["strategy"] = resolve_strategy_alias(strategy)
        return super().instantiate_trainer(**kwargs)


def written_dirs(trainer: Any) -> list[tuple[str, str]]:
    """The folders ``fit`` writes, each with the key that sets it: the log directory, then the checkpoints'."""
    logger = trainer.loggers[0] if trainer.loggers else None
    key = "trainer.logger.save_dir" if logger is not None and logger.save_dir else "trainer.default_root_dir"
    dirs = [(getattr(logger, "log_dir", None) or getattr(logger, "save_dir", None) or trainer.default_root_dir, key)]
    callback = trainer.checkpoint_callback
    if callback is not None:
        dirs.append((str(checkpoint_dir(trainer)), "checkpoint.dirpath" if callback.dirpath else key))
    return dirs


#: What ``fit`` writes into its log directory (``trainer.log_dir``), besides checkpoints.
RUN_FILES = ("config.yaml", "trajectories.jsonl", "eval_trajectories.jsonl", "hf", "hf_adapter")


def check_run_files(trainer: Any, config_inputs: list[str], resuming: bool) -> None:
    """Without a logger, ``fit`` writes its run files (:data:`RUN_FILES`) into ``trainer.default_root_dir`` itself,
    by default the working directory: refused in one line where one of them is already there and this run does
    not resume the run that wrote it, and always where ``config.yaml`` there is a ``--config`` file of this run
    (it would be overwritten). With a logger, each run has a version folder of its own."""
    if trainer.loggers:  # every rank checks (read-only), so that all stop alike
        return
    folder = Path(trainer.default_root_dir).resolve()
    config_file = folder / "config.yaml"
    if config_file.exists() and str(config_file) in {str(Path(p).resolve()) for p in config_inputs}:
        found = [config_file.name + " (this run's --config, which the run's resolved config would overwrite)"]
    elif resuming:
        return
    else:
        found = [name for name in RUN_FILES if (folder / name).exists()]
    if found:
        raise ConfigError(
            f"trainer.logger is off, so this run writes config.yaml, trajectories.jsonl and hf/ into "
            f"trainer.default_root_dir ({folder}), which already has {', '.join(found)}; set "
            "--trainer.default_root_dir to a folder of its own, or keep a logger (each run then gets a version "
            "folder)")


def stop_timeout() -> float | None:
    """``RLFLOW_STOP_TIMEOUT``: seconds a signalled run may take to reach the end of its step (0: no bound)."""
    text = os.environ.get("RLFLOW_STOP_TIMEOUT")
    if text is None:
        return STOP_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        raise ConfigError(f"RLFLOW_STOP_TIMEOUT must be a number of seconds (0: no bound), got {text!r}") from None
    return seconds if seconds > 0 else None


JUDGER_HELP = "--data.judging.judgers.help"


def function_judger_help(argv: list[str]) -> None:
    """``--data.judging.judgers.help NAME`` for a judger that is a function (``env_reward``, a TRL reward function by
    import path): print its documentation and exit, as jsonargparse's help does for a judger class (which it
    cannot do for a function: it documents subclasses of ``Judger`` only). Anything else is left to jsonargparse."""
    name = None
    for i, arg in enumerate(argv):
        if arg == JUDGER_HELP and i + 1 < len(argv):
            name = argv[i + 1]
        elif arg.startswith(JUDGER_HELP + "="):
            name = arg.split("=", 1)[1]
    if not name:
        return
    try:
        obj, _ = registry.resolve_spec("rlflow.judgers", name)
    except registry.PluginError:
        return  # jsonargparse reports it (an unknown name lists the available ones)
    if isinstance(obj, type) or not callable(obj):
        return
    doc = inspect.cleandoc(obj.__doc__ or "(no docstring)")
    print(f"{name}: a function judger ({obj.__module__}.{getattr(obj, '__qualname__', obj)}{inspect.signature(obj)})"
          f"\n\n{doc}\n\nIt takes no options: list it in data.judging.judgers by name (or as {{class_path: function, "
          f"init_args: {{path: ...}}}} to rename columns, see docs/judgers.md). It is called with TRL's reward "
          f"function arguments (prompts, completions, completion_ids and the data's columns) and returns one "
          f"float or None per completion.")
    raise SystemExit(0)


#: Warnings of the libraries rlflow runs on that say nothing a user can act on, with their categories:
#: - Lightning's data fetcher builds torch pytree ``LeafSpec`` objects, which torch >= 2.10 deprecates (a
#:   FutureWarning on every run);
#: - Lightning asks for DataLoader workers on any machine with more than 2 cores (seen on a 16-core GPU machine),
#:   but rlflow's loaders hand out prompt records only: the rollout that makes a batch runs in the trainer's
#:   process (or rlflow's own generator process), with the live policy, and cannot move into workers;
#: - without eval data ``val_dataloader`` returns ``[]``, Lightning's way to skip validation, which it then
#:   reports as "Total length of `list` across ranks is zero".
LIBRARY_WARNINGS = (
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning),
    (r"The '(train|val)_dataloader' does not have many workers", Warning),
    (r"Total length of `list` across ranks is zero", Warning),
)


def cli_main(args: list[str] | None = None, run: bool = True, cli_class: type[RLFlowCLI] | None = None) -> RLFlowCLI:
    """Build (and with ``run``, run) the CLI; ``cli_class`` lets a tool such as ``rlflow data check`` reuse it."""
    for message, category in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    return (cli_class or RLFlowCLI)(
        GRPOModule,
        RolloutDataModule,
        args=args,
        run=run,
        seed_everything_default=0,
        trainer_class=RLFlowTrainer,
        trainer_defaults=dict(TRAINER_DEFAULTS),
        save_config_callback=LoggerSaveConfigCallback,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )


#: The option each plugin base class is the type of (``str | PolicyLoss`` ...), to name it in errors.
PLUGIN_OPTIONS = {
    "rlflow.judgers.base.Judger": "data.judging.judgers",
    "rlflow.losses.base.PolicyLoss": "model.loss",
    "rlflow.advantages.base.AdvantageEstimator": "data.advantage",
    "rlflow.rollout.base.RolloutBackend": "data.rollout",
}
ROLLOUT_GROUP = "rlflow.rollout"
#: jsonargparse's own lines in a union error (what each subtype expects), not a plugin's message.
JSONARGPARSE_LINES = ("Expected a <class", "Does not validate against any", "Not a valid subclass of",
                      "Subclass types expect", "a class path (str)", "a dict with", "a dict without")


def plugin_argument_error(exc: BaseException) -> str | None:
    """jsonargparse's error for a plugin whose ``init_args`` its constructor refused ("Does not validate against
    any of the Union subtypes", the plugin's own message buried in it, with a dump of every argument), as one line
    naming the option, the plugin class and the plugin's message; None for any other error."""
    text = str(exc)
    if not isinstance(exc, ValueError) or not text.startswith("Does not validate against any of the Union subtypes"):
        return None
    # the plugin's own messages, at any depth of nested unions (a judger inside data.judging.judgers' mapping)
    listed = [m.group(1) for line in text.splitlines() if (m := re.match(r"^\s+- (.*)$", line))]
    reasons = [r for r in listed if not r.startswith(JSONARGPARSE_LINES)] or [
        line[4:] for line in text.splitlines()
        if line.startswith("  - ") and not line.startswith("  - Expected a <class 'str'>")]
    if not reasons:
        return None
    bases = re.findall(r"(rlflow\.[\w.]+)", text.splitlines()[1] if len(text.splitlines()) > 1 else "")
    option = next((PLUGIN_OPTIONS[b] for b in bases if b in PLUGIN_OPTIONS), None)
    plugin = re.search(r"class_path='([\w.]+)'", text)
    if option is None:  # nested (a judger in a mapping) or a settings group (model.lora): the message names the key
        return "; ".join(reasons) + (f" ({plugin.group(1)})" if plugin else "")
    return f"{option}" + (f" ({plugin.group(1)})" if plugin else "") + f": {'; '.join(reasons)}"


#: Lightning's modules that check the Trainer's and the callbacks' arguments: a ``ValueError`` raised there (an
#: unknown ``trainer.strategy`` name) is about a value the user gave, as is every ``MisconfigurationException``.
LIGHTNING_ARGUMENT_CHECKS = (f"trainer{os.sep}connectors{os.sep}", f"{os.sep}callbacks{os.sep}")


def lightning_argument_error(exc: BaseException) -> str | None:
    """Lightning's refusal of a Trainer or callback argument (``trainer.max_steps: -5``, ``trainer.strategy:
    nonsense``, ``checkpoint.save_top_k: -2``) as its own one-line message; None for any other error."""
    if isinstance(exc, MisconfigurationException):
        return str(exc)
    frames = traceback.extract_tb(exc.__traceback__)
    raised_in = frames[-1].filename if frames else ""
    checks = f"lightning{os.sep}pytorch{os.sep}" in raised_in and any(p in raised_in for p in LIGHTNING_ARGUMENT_CHECKS)
    return str(exc) if checks else None


def main(argv: list[str] | None = None) -> int:
    """Lightning's subcommands (``fit``, ``validate``, ...); ``rlflow.entry`` dispatches the others first."""
    try:
        cli_main(argv)
    except StoppedBySignal as exc:  # not an error: 128 + the signal, as a shell reports a process it ended
        print(f"rlflow: {exc}", file=sys.stderr)
        return exc.exit_code
    except (*USER_ERRORS, ValueError, MisconfigurationException) as exc:
        message = str(exc) if isinstance(exc, USER_ERRORS) else (
            plugin_argument_error(exc) or lightning_argument_error(exc))
        if message is None or os.environ.get("RLFLOW_TRACEBACK"):
            raise
        print(f"rlflow: error: {message}\n(set RLFLOW_TRACEBACK=1 for the full traceback)", file=sys.stderr)
        return 1
    return 0


def _user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "fix your input", not "rlflow has a bug": printed as one line by ``main``."""
    from rlflow.data.dataset import DataError
    from rlflow.registry import PluginError
    from rlflow.training.module import NonFiniteLossError

    return (ConfigError, DataError, PluginError, NonFiniteLossError, DiskFullError, FileNotFoundError)


USER_ERRORS = _user_errors()
