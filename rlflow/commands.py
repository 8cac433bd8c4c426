"""The ``rlflow`` console script's commands and its ``--help`` (:mod:`rlflow.entry` dispatches them)."""

USAGE = """usage: rlflow COMMAND [options]

rlflow trains language models with GRPO (group-relative policy optimisation) on PyTorch Lightning.

commands:
  fit --config C.yaml        train: sample prompts, generate each k times, judge, update the policy
  validate --config C.yaml   evaluate on data.eval_data_path (add --ckpt_path last for a run's checkpoint)
  data check --config C.yaml read, route and tokenize every row of a config's data, naming bad rows
  plugins [--check]          list the installed judgers, losses, advantages, rollout backends, tools
  export --ckpt_path P --out DIR
                             write a checkpoint's policy as a Hugging Face model
  config from-trl T.yaml     write an rlflow config from a TRL GRPOConfig

Each command's options: rlflow COMMAND --help. Guide: docs/index.md."""

#: The commands Lightning's CLI runs (:mod:`rlflow.cli`); rlflow's module has no ``test_step`` or ``forward``, so
#: Lightning's ``test`` and ``predict`` are not offered.
LIGHTNING_COMMANDS = ("fit", "validate")

#: Every command :func:`rlflow.entry.main` dispatches.
COMMANDS = ("plugins", "data", "config", "export", *LIGHTNING_COMMANDS)
