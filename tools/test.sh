#!/usr/bin/env bash
# Runs the test suite from nothing: install into ./.venv, then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
# shellcheck disable=SC1091
. "${RLFLOW_VENV:-.venv}/bin/activate"
python -m pytest -q "$@"
