#!/usr/bin/env bash
# Creates ./.venv (once) and installs rlflow into it: torch first, through pip (so pip's configuration picks the
# build: the CPU wheel here), then rlflow[dev] editable and the example plugins. The second install goes through uv
# (which pip installs into the venv first) where it can, since uv resolves and unpacks in parallel; otherwise, or if
# uv fails, through pip. Neither compiles bytecode for every installed file; instead one import of what `rlflow fit`
# loads writes the bytecode of those modules (even where PYTHONDONTWRITEBYTECODE is set), and Python writes the
# rest on first import. Re-running is cheap: nothing is reinstalled while the pyproject files and this script are
# unchanged. Override the torch requirement with RLFLOW_TORCH (e.g. a CUDA build on a GPU box); set RLFLOW_NO_UV=1
# to install with pip only.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${RLFLOW_VENV:-.venv}
TORCH=${RLFLOW_TORCH:-torch==2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"

# bubblewrap: the python tool's sandbox (rlflow/tools/sandbox.py). Installed where this script may (root, apt);
# elsewhere skipped without a word, and the tool says at start-up what is missing.
if ! command -v bwrap >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  { apt-get install -y -qq bubblewrap || { apt-get update -qq && apt-get install -y -qq bubblewrap; }; } \
    >/dev/null 2>&1 || true
fi

stamp="$VENV/.rlflow-install-stamp"
want=$(cat pyproject.toml plugins/*/pyproject.toml tools/setup_env.sh 2>/dev/null | sha256sum | cut -d' ' -f1)-$TORCH
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "[setup] installing $TORCH (the CPU wheel here; a plain 'torch' would pull GBs of CUDA packages)"
python -m pip install -q --no-compile "$TORCH"
packages=(-e ".[dev]")
for plugin in plugins/*/; do
  [ -f "$plugin/pyproject.toml" ] && packages+=(-e "$plugin")
done
echo "[setup] installing rlflow[dev] and the example plugins"
if [ -z "${RLFLOW_NO_UV:-}" ] && python -m pip install -q --no-compile uv >/dev/null 2>&1 \
    && python -m uv pip install -q --python "$VENV/bin/python" "${packages[@]}"; then
  :
else
  python -m pip install -q --no-compile "${packages[@]}"
fi
echo "[setup] writing the bytecode of the modules rlflow fit imports"
env -u PYTHONDONTWRITEBYTECODE python -c "import rlflow.cli, rlflow.training.module, rlflow.rollout.engine" \
  >/dev/null 2>&1 || true
echo "$want" > "$stamp"
