#!/usr/bin/env bash
# Runs the test suite from nothing: install into ./.venv, then pytest, spread over the cores by pytest-xdist
# (RLFLOW_TEST_WORKERS workers; default: one more than the cores, since many tests wait on other processes, timeouts
# or sleeps). torch's OpenMP threads sleep rather than spin while they wait (OMP_WAIT_POLICY=PASSIVE): with more
# workers than cores, spinning threads would take the cores from the workers that have work. Extra arguments go to
# pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
# shellcheck disable=SC1091
. "${RLFLOW_VENV:-.venv}/bin/activate"
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
# ~200 Python processes start during the suite: let each module be compiled once, not in every process.
unset PYTHONDONTWRITEBYTECODE
workers="${RLFLOW_TEST_WORKERS:-$(( $(nproc) + 1 ))}"
python -m pytest -q -n "$workers" --dist worksteal "$@"
