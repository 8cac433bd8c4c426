#!/usr/bin/env bash
# The embedded CPU demo, from nothing: install into ./.venv, build the tiny Qwen3 policy and its arithmetic
# data if absent, then GRPO-train it with `rlflow fit --config configs/demo_cpu.yaml`. Extra arguments go to
# rlflow fit (e.g. --trainer.max_steps 10).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
# shellcheck disable=SC1091
. "${RLFLOW_VENV:-.venv}/bin/activate"
python tools/make_tiny_model.py --out checkpoints/tiny-qwen3 --data-out checkpoints/arith
rlflow fit --config configs/demo_cpu.yaml "$@"
python tools/summarize_run.py runs/demo
