"""Every code block marked runnable in README.md and docs/ runs as written.

The convention (docs/contributing.md): a fenced block whose info string is ``bash runnable`` or
``python runnable``. Blocks run in a scratch directory with links to the repository's ``configs/``, ``tools/``,
``tests/`` and ``plugins/`` and to the tiny test model and its data as ``checkpoints/tiny-qwen3`` and
``checkpoints/arith``, so a block can name the demo config without building the demo model.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+)(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$",
                   re.M | re.S)


def runnable_blocks() -> list[tuple[str, int, str, str]]:
    """``(file, line, language, code)`` of every runnable block."""
    blocks = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text()
        for match in FENCE.finditer(text):
            words = match.group("info").split()
            if len(words) >= 2 and words[1] == "runnable":
                indent = match.group("indent")
                code = "".join(line[len(indent):] if line.startswith(indent) else line
                               for line in match.group("body").splitlines(keepends=True))
                line = text.count("\n", 0, match.start()) + 1
                blocks.append((path.relative_to(ROOT).as_posix(), line, words[0], code))
    return blocks


BLOCKS = runnable_blocks()


def test_the_convention_finds_blocks():
    languages = {language for _, _, language, _ in BLOCKS}
    assert len(BLOCKS) >= 5 and languages == {"bash", "python"}, BLOCKS


@pytest.fixture(scope="module")
def scratch(tiny_model, tiny_data, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runnable")
    for name in ("configs", "tools", "tests", "plugins"):
        (root / name).symlink_to(ROOT / name)
    (root / "checkpoints").mkdir()
    (root / "checkpoints" / "tiny-qwen3").symlink_to(tiny_model)
    (root / "checkpoints" / "arith").symlink_to(tiny_data)
    return root


@pytest.mark.parametrize(("where", "line", "language", "code"), BLOCKS,
                         ids=[f"{where}:{line}" for where, line, _, _ in BLOCKS])
def test_runnable_block(where, line, language, code, scratch, tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "OMP_NUM_THREADS": "1"}
    script = tmp_path / ("block.sh" if language == "bash" else "block.py")
    script.write_text(code)
    command = ["bash", "-e", str(script)] if language == "bash" else [sys.executable, str(script)]
    done = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{where}:{line} ({language} runnable) failed:\n{done.stdout}\n{done.stderr}"
