#!/usr/bin/env bash
# Runs the test suite from nothing: install into ./.venv, then pytest, spread over the cores by pytest-xdist
# (RLFLOW_TEST_WORKERS workers; default: one per core). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
# shellcheck disable=SC1091
. "${RLFLOW_VENV:-.venv}/bin/activate"
python -m pytest -q -n "${RLFLOW_TEST_WORKERS:-auto}" "$@"
