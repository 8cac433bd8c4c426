#!/usr/bin/env bash
# The embedded CPU demo, from nothing: install into ./.venv, build the tiny Qwen3 policy and its arithmetic
# data if absent, then GRPO-train it with `rlflow fit --config configs/demo_cpu.yaml`. Extra arguments go to
# rlflow fit (e.g. --trainer.max_steps 10). `tools/demo.sh smollm2` trains SmolLM2-135M-Instruct instead
# (configs/smollm2_sums_cpu.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup_env.sh
# shellcheck disable=SC1091
. "${RLFLOW_VENV:-.venv}/bin/activate"
# The install writes bytecode only for what `rlflow fit` imports: let Python cache the rest on first import.
unset PYTHONDONTWRITEBYTECODE
if [ "${1:-}" = "smollm2" ]; then  # a real pretrained model: SmolLM2-135M-Instruct on sums in GSM8K's format
  shift
  python tools/get_smollm2.py --out checkpoints/smollm2-135m-instruct
  python -m rlflow.demo.sums --out checkpoints/sums
  rlflow fit --config configs/smollm2_sums_cpu.yaml "$@"
  python tools/summarize_run.py runs/smollm2_sums
  exit 0
fi
python tools/make_tiny_model.py --out checkpoints/tiny-qwen3 --data-out checkpoints/arith
rlflow fit --config configs/demo_cpu.yaml "$@"
python tools/summarize_run.py runs/demo
