"""The ``rlflow`` command: Lightning's CLI for ``fit``/``validate``, plus ``rlflow plugins``.

``rlflow fit --config a.yaml [--config b.yaml] [--model.lr 1e-6]`` builds a :class:`GRPOModule`, a
:class:`RolloutDataModule` and a ``Trainer`` from jsonargparse configs (``--print_config`` shows the resolved
one). The tokenizer, temperature and completion budget are linked from one place to where they are needed.
"""

from __future__ import annotations

import sys

from lightning.pytorch.cli import LightningCLI

from rlflow.data.datamodule import RolloutDataModule
from rlflow.module import GRPOModule

TRAINER_DEFAULTS = {
    "log_every_n_steps": 1,
    "num_sanity_val_steps": 0,
    "use_distributed_sampler": False,
    "enable_model_summary": False,
}


class RLFlowCLI(LightningCLI):
    """LightningCLI with rlflow's argument links and defaults."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("model.model_path", "data.tokenizer_path")
        parser.link_arguments("data.temperature", "model.temperature")
        parser.link_arguments("data.max_tokens", "model.max_tokens")


def cli_main(args: list[str] | None = None, run: bool = True) -> RLFlowCLI:
    return RLFlowCLI(
        GRPOModule,
        RolloutDataModule,
        args=args,
        run=run,
        seed_everything_default=0,
        trainer_defaults=dict(TRAINER_DEFAULTS),
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "plugins":
        from rlflow.plugins_cmd import main as plugins_main

        return plugins_main(args[1:])
    cli_main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
