"""``ConfigError``: the one exception for an invalid configuration value (its own module: everything imports it).

``rlflow.cli.main`` prints it as one ``rlflow: error:`` line; the checks that raise it are in
:mod:`rlflow.config_checks` and :mod:`rlflow.models.model_path`.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the option and the value given.

    A ``ValueError``, so that callers catching the errors raised before it existed keep working.
    """
