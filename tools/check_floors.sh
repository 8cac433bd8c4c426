#!/usr/bin/env bash
# Runs the test suite against the oldest versions pyproject.toml allows: a fresh virtual environment with the oldest
# Python rlflow supports, rlflow[dev] and the example plugins installed by uv with --resolution lowest-direct (each
# direct dependency at its declared floor; their own dependencies resolved as usual), then pytest as
# tools/test.sh runs it. Raise a floor in pyproject.toml when a test fails here and passes on the newer version.
# Needs the package index (torch from it is its default build, several GB). Environment: PYTHON (default python3.11),
# FLOORS_VENV (default /tmp/rlflow-floors; removed first). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
VENV=${FLOORS_VENV:-/tmp/rlflow-floors}
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q uv
packages=(-e ".[dev]")
for plugin in plugins/*/; do
  [ -f "$plugin/pyproject.toml" ] && packages+=(-e "$plugin")
done
"$VENV/bin/python" -m uv pip install -q --python "$VENV/bin/python" --resolution lowest-direct "${packages[@]}"
"$VENV/bin/python" -m uv pip list --python "$VENV/bin/python" 2>/dev/null \
  | grep -i -E '^(torch|lightning|transformers|jsonargparse|torchmetrics|wandb|packaging|ninja|trl|peft|datasets) '
# the float32 decode kernel is compiled against this torch, in a cache of its own
export TORCH_EXTENSIONS_DIR="$VENV/torch_extensions" OMP_WAIT_POLICY=PASSIVE
unset PYTHONDONTWRITEBYTECODE
"$VENV/bin/python" -m pytest -q -n "${RLFLOW_TEST_WORKERS:-$(( $(nproc) + 1 ))}" --dist worksteal -p no:cacheprovider "$@"
