"""Benchmarks and profiles of rlflow: scripts that measure (speed, memory, FLOP/s) and print what they measured.

Each module is a script (``python benchmarks/<name>.py --help``) whose functions the tests in
``tests/benchmarks/`` import (``import benchmarks.<name>``); ``README.md`` beside this file lists what each one
measures. :mod:`benchmarks.plain_generate` is the ``model.generate`` anchor the rollout benchmarks time rlflow's
engine against.
"""
