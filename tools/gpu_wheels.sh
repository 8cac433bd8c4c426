#!/usr/bin/env bash
# Download, here, the wheels tools/gpu_check.sh installs on a GPU machine that has no package index.
#
# The lent GPU machines' image (Python 3.12) has torch, lightning, transformers, torchmetrics, peft and pytest, but
# not jsonargparse (rlflow's CLI) nor ninja (which builds rlflow's CPU row GEMM), and an older transformers than rlflow
# is tested with; nothing can be downloaded there. This fetches pure-Python wheels of those packages into .whl/ (git-ignored), sized well under the 64 MiB a
# device call carries:
#
#   bash tools/gpu_wheels.sh            # here, with pip and the package registry
#   # then, through the device tool: command "bash tools/gpu_check.sh", carry [".whl", "checkpoints"]
#
# Versions: those of this venv (what the CPU suite passed with), so the GPU run tests the same code paths.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
PKGS=()
# transformers' other requirements (huggingface-hub >= 1.31, tokenizers 0.23, safetensors 0.8) are in the image at
# fitting versions; regex is carried since transformers checks its version at import.
for name in jsonargparse docstring-parser typeshed-client transformers regex ninja; do
  PKGS+=("$name==$(version "$name")")
done
mkdir -p .whl
rm -f .whl/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${PKGS[@]}"
ls -la .whl
du -sh .whl
