"""The ``rlflow`` console script: dispatches ``plugins``, ``data``, ``config`` and ``export`` without importing
Lightning.

``rlflow plugins`` and ``rlflow data check`` answer in about a second; ``rlflow config from-trl`` writes an rlflow
config from a TRL one (:mod:`rlflow.trl_config`); ``rlflow export`` writes a checkpoint's
policy as a Hugging Face model (:mod:`rlflow.training.export`); every other command (``fit``,
``validate``, ...) goes to Lightning's CLI in :mod:`rlflow.cli`; ``fit`` first starts a pipelined run's generator
process (:mod:`rlflow.rollout.prestart`), so that its imports overlap Lightning's. Every command first checks the
installed dependencies against rlflow's declared ranges (:mod:`rlflow.requirements`; ``RLFLOW_IGNORE_REQUIREMENTS=1``
turns the stop into a warning).
"""

from __future__ import annotations

import gc
import os
import sys

from rlflow.commands import COMMANDS, USAGE


def script() -> int:
    """The console script (and ``python -m rlflow``): :func:`main`, then a quick exit. Everything still alive is
    frozen out of the garbage collector first (``gc.freeze``): the interpreter's last collection would otherwise
    walk every object torch, transformers and Lightning created, after the command has done its work. Exit handlers
    still run (loggers, W&B, the generator process's stop)."""
    add_working_directory()
    try:
        return main()
    except BrokenPipeError:  # the reader went away (rlflow plugins | head): stop quietly, as other commands do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit would raise again
        return 141
    finally:
        gc.freeze()


def add_working_directory() -> None:
    """Let import paths in a config (``my_rewards:accuracy``, a tool, an environment) name modules in the working
    directory, as ``python -m rlflow`` does: the console script's ``sys.path`` starts at its own folder instead. The
    directory goes last, so a file there never hides an installed package."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(USAGE, file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    if args[0] not in COMMANDS and not args[0].startswith("-"):
        print(f"rlflow: error: {args[0]!r} is not a command; the commands are fit, validate, data check, plugins, "
              "export and config from-trl (rlflow --help)", file=sys.stderr)
        return 2
    from rlflow.requirements import message, unmet

    problems = unmet()
    if problems:  # a dependency outside rlflow's declared range fails far from here otherwise
        if os.environ.get("RLFLOW_IGNORE_REQUIREMENTS") != "1":
            print(message(problems), file=sys.stderr)
            return 2
        print(message(problems, "warning (RLFLOW_IGNORE_REQUIREMENTS=1)"), file=sys.stderr)
    if args[0] == "plugins":
        from rlflow.plugins_cmd import main as plugins_main

        return plugins_main(args[1:])
    if args and args[0] == "data":
        from rlflow.data.check import main as data_main

        return data_main(args[1:])
    if args and args[0] == "config":
        from rlflow.trl_config.command import main as config_main

        return config_main(args[1:])
    if args and args[0] == "export":
        from rlflow.training.export import main as export_main

        return export_main(args[1:])
    if args and args[0] == "fit":  # a pipelined run: its generator process imports beside the trainer
        from rlflow.rollout import prestart

        prestart.KEEP_WORKERS = False  # the process ends with its one run: no worker kept for a next one
        prestart.from_argv(args[1:])
    from rlflow.cli import main as cli_main

    return cli_main(argv)
