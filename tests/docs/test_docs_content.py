"""README.md and the guide as a user reads them: the README is a short front door, every page it links to
exists, and no page narrates how the work went."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
USER_DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]

# words that narrate work instead of describing the software ("turn" only where it is a unit of work: the
# model's turns of a multi-turn rollout are a feature)
HISTORY = re.compile(
    r"\bsessions?\b|\b(?:this|last|previous|an? (?:earlier|later)|the (?:first|second|third|next)) round\b"
    r"|\b(?:a later|an earlier|a slower|a faster|slower|faster) day\b|\bwe (?:tried|measured|added|changed)\b"
    r"|\b(?:this|that|previous|earlier) turn\b(?! of)",
    re.I)
NOT_HISTORY = re.compile(r"requests\.Session|aiohttp|ClientSession|http session", re.I)


def test_readme_is_at_most_15_kb():
    size = (ROOT / "README.md").stat().st_size
    assert size <= 15 * 1024, f"README.md is {size} bytes; details belong in the guide under docs/"


def test_no_page_narrates_history():
    found = []
    for path in USER_DOCS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if HISTORY.search(line) and not NOT_HISTORY.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not found, "history words in user docs:\n" + "\n".join(found)


def test_the_history_check_catches_narration():
    for text in ("in the tenth session the step got faster", "this round's figures", "measured on a slower day",
                 "we tried two threads", "as a later round found"):
        assert HISTORY.search(text), text
    for text in ("the model's next turn", "max_rounds rounds in all", "session_len of the engine",
                 "later turns decode side by side"):
        assert not HISTORY.search(text), text


def test_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert local and all((ROOT / t).exists() for t in local), [t for t in local if not (ROOT / t).exists()]


def test_readme_keeps_the_quick_start_commands():
    text = (ROOT / "README.md").read_text()
    assert "bash tools/demo.sh" in text and "bash tools/test.sh" in text
    assert "bash tools/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_every_file_the_docs_name_exists():
    """A script, config or module named in README.md, CHANGELOG.md or the guide is where the text says."""
    named = re.compile(r"\b(?:tools|benchmarks|configs|plugins|tests|rlflow)/[\w./-]*\.(?:py|sh|yaml|jsonl|md|toml)\b")
    missing = sorted({f"{path.relative_to(ROOT)}: {name}" for path in USER_DOCS
                      for name in named.findall(path.read_text()) if not (ROOT / name).exists()})
    assert not missing, missing


def test_readme_minimal_config_parses(tmp_path):
    """The README's minimal config is valid for ``rlflow fit`` (its keys and types; nothing is loaded)."""
    section = (ROOT / "README.md").read_text().split("## A minimal config", 1)[1]
    config = tmp_path / "minimal.yaml"
    config.write_text(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))
    done = subprocess.run([sys.executable, "-m", "rlflow", "fit", "--config", str(config), "--print_config"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "max_tokens: 512" in done.stdout and "epsilon_high: 0.28" in done.stdout


def test_every_flag_the_docs_pass_to_a_script_exists():
    """``python tools/x.py --flag`` and ``python benchmarks/x.py --flag`` in the docs name flags the script has."""
    command = re.compile(r"python ((?:tools|benchmarks)/\w+\.py)([^`|\n;&]*)")
    uses: dict[str, set[str]] = {}
    for path in USER_DOCS:
        for script, args in command.findall(path.read_text()):
            uses.setdefault(script, set()).update(re.findall(r"(?<![\w-])--[a-z][\w-]*", args.split(" -- ")[0]))
    assert "benchmarks/bench_step.py" in uses
    scripts = [script for script, flags in sorted(uses.items()) if flags]
    # one process prints every script's --help (each run as `python <script> --help` runs it, by runpy): most of
    # a script's start is its imports, which the scripts share
    printer = (
        "import contextlib, io, json, runpy, sys\n"
        "helps = {}\n"
        "for script in sys.argv[1:]:\n"
        "    out, sys.argv = io.StringIO(), [script, '--help']\n"
        "    try:\n"
        "        with contextlib.redirect_stdout(out):\n"
        "            runpy.run_path(script, run_name='__main__')\n"
        "        helps[script] = 'no SystemExit from --help'\n"
        "    except SystemExit as exc:\n"
        "        helps[script] = out.getvalue() if exc.code in (0, None) else f'exit {exc.code}: {out.getvalue()}'\n"
        "print(json.dumps(helps))\n")
    done = subprocess.run([sys.executable, "-c", printer, *scripts], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    helps = json.loads(done.stdout.strip().splitlines()[-1])
    unknown = []
    for script in scripts:
        assert "usage:" in helps[script], f"{script} --help: {helps[script]}"
        unknown += [f"{script} {flag}" for flag in sorted(uses[script]) if flag not in helps[script]]
    assert not unknown, unknown
