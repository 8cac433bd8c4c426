"""TRL GRPO configs in rlflow: ``rlflow config from-trl`` (:mod:`rlflow.trl_config.command`) converts one, from the
table of every TRL field with its rlflow key or the reason it has none (:mod:`rlflow.trl_config.fields`), which
also writes the field tables of the guide's "Coming from TRL" page (:mod:`rlflow.trl_config.page`).

Nothing here imports TRL, torch or Lightning: the conversion reads the file and the table only.
"""
