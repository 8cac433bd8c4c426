"""The commands that build or fetch the demos' and recipes' local models and data (``checkpoints/...`` in the shipped
configs), for the error that finds one missing."""

from __future__ import annotations

from pathlib import PurePath

TINY = "python tools/make_tiny_model.py --out checkpoints/tiny-qwen3 --data-out checkpoints/arith"
TOOLS = "python tools/make_tiny_tool_model.py --out checkpoints/tiny-tool-qwen3 --data-out checkpoints/mult"
SMOLLM2 = "python tools/get_smollm2.py --out checkpoints/smollm2-135m-instruct"
SUMS = "python -m rlflow.demo.sums --out checkpoints/sums"

#: ``checkpoints/<folder>`` -> the command that writes it.
BUILDS = {
    "tiny-qwen3": TINY, "arith": TINY, "tiny-tool-qwen3": TOOLS, "mult": TOOLS,
    "smollm2-135m-instruct": SMOLLM2, "sums": SUMS,
}


def build_command(path: str) -> str | None:
    """The command that writes ``path`` (a shipped config's model or data under ``checkpoints/``), or None."""
    parts = PurePath(path).parts
    for i, part in enumerate(parts[:-1]):
        if part == "checkpoints" and parts[i + 1] in BUILDS:
            return BUILDS[parts[i + 1]]
    return None


def missing_hint(path: str) -> str:
    """``"; build it with '<command>'"`` for a missing demo path, else ``""``."""
    command = build_command(path)
    return f"; build it with '{command}'" if command else ""
