#!/usr/bin/env bash
# The GPU checks, in one run on a lent GPU machine, most wanted first: the engine (its decode steps as CUDA graphs,
# the default, and eager) against model.generate and transformers' continuous batching (generate_batch) on a
# random-init model of Qwen3-0.6B's shape at 16 prompts x 8 x 128 tokens (float32 and bf16; DTYPES=bfloat16 for bf16
# alone) and 64 x 8 x 512 in bf16; the gpu-marked tests; rlflow fit on the GPU (the demo config in bf16-mixed with
# data.rollout: auto, the 0.6B shape packed under FSDP2 with gradient checkpointing; both log the rollout/training
# log-prob gap); achieved FLOP/s against the GPU's matmul peak; then the tiny model's rollout, the engine's RMS-norm
# option, and the demo config under FSDP2 and pipelined. Everything it prints also goes to $OUT/gpu_check.log, and
# each run's metrics.csv to $OUT.
#
# The machine has no package index. Prepare it here, then start it through the device tool:
#   bash tools/gpu_wheels.sh          # jsonargparse, transformers, ... as wheels in .whl/
#   bash tools/demo.sh                # (or make_tiny_model.py) so checkpoints/tiny-qwen3 and checkpoints/arith exist
#   device run: command "bash tools/gpu_check.sh", carry [".whl", "checkpoints/tiny-qwen3",
#               "checkpoints/arith", "rlflow.egg-info"], timeout_s 560
# A device command runs for 10 minutes at most, so a call may end before the last steps: on an H200 the steps before
# the gpu-marked tests took 8 minutes, 6 of them the 64 x 8 x 512 rollout (generate_batch alone 2.5). Leave out the
# large rollout (SKIP_LARGE=1), the FLOP/s bench (SKIP_FLOPS=1) or the steps after it (SKIP_MORE=1) to fit.
# The rollouts give every timed run other prompts (--fresh-prompts), as training does, so per-shape set-up costs
# (cuDNN's attention plans) are paid where training pays them. The 64 x 8 x 512 rollouts turn cuDNN's attention off
# for model.generate too (--no-cudnn-attention): inside it, generate failed at that size on an H200 (torch 2.11). FOCUS=decode runs, instead of all this, where a decode
# step's time goes: one layer's attention variants (bench_decode_attention.py), the engine (attention groups and
# rows) against generate at 64 x 8 x 512, the same engines with max_batch_size 512, the engine alone under the
# profiler at 16 x 8 x 128 (FOCUS_STEPS picks among "attention target large512 small large"; large: 32 x 8 x 512
# under the profiler); about 6 minutes on an H200.
# RLFLOW_CHECK_DEVICE=cpu SHAPE_LAYERS=2 runs the same steps on a CPU, smaller (a dry run of the script itself). A
# step that fails is reported and the rest still run; the exit status is 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu_check.log") 2>&1
PY=${PYTHON:-python3}
DTYPES=${DTYPES:-both}  # the 16-row rollout's precisions: both, or bfloat16 alone
DEVICE=${RLFLOW_CHECK_DEVICE:-cuda}
export PYTHONUNBUFFERED=1
# the image's own packages may lie outside rlflow's declared ranges: run anyway, the environment step names them
export RLFLOW_IGNORE_REQUIREMENTS=1
failed=()
step() { echo; echo "=== $* ($(date +%T))"; }
run() { "$@" || { echo "FAILED (exit $?): $*"; failed+=("$*"); }; }

if [ "$DEVICE" = cuda ]; then
  ACCELERATOR=gpu; TOKENS=128; FIT_TOKENS=64; STEPS=10; SHAPE_STEPS=3; SHAPE_PROMPTS=16; PROMPTS=16; LARGE_PROMPTS=64; LARGE_TOKENS=512
else
  ATTENTION_SHAPES=${ATTENTION_SHAPES:-4x8x48x32 2x8x48x100}
  ACCELERATOR=cpu; TOKENS=16; FIT_TOKENS=16; STEPS=2; SHAPE_STEPS=1; SHAPE_PROMPTS=2; PROMPTS=4; LARGE_PROMPTS=4; LARGE_TOKENS=24
fi

step "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
SITE=/tmp/rlflow-site
if compgen -G ".whl/*.whl" >/dev/null && "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  # the packages the image lacks (tools/gpu_wheels.sh; built for the image's Python 3.12)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import transformers" 2>/dev/null; then
  echo "the carried transformers does not import here; using the image's own"
  rm -rf "$SITE"/transformers "$SITE"/transformers-*
fi
# rlflow's plugins are entry points: they need its metadata (rlflow.egg-info, carried, or an editable install)
[ -d rlflow.egg-info ] || "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
  || echo "no rlflow metadata: plugin names will not resolve"
"$PY" - <<'EOF' || { echo "rlflow does not import; stopping"; exit 1; }
import torch, transformers, lightning, jsonargparse, rlflow
from rlflow import registry
print(f"python torch {torch.__version__} transformers {transformers.__version__} lightning {lightning.__version__} "
      f"jsonargparse {jsonargparse.__version__}; cuda {torch.cuda.is_available()}"
      + (f" ({torch.cuda.get_device_name()}, bf16 {torch.cuda.is_bf16_supported()})" if torch.cuda.is_available() else ""))
print("rollout backends:", ", ".join(sorted(registry.available("rlflow.rollout"))))
from rlflow.requirements import unmet
print("outside rlflow's ranges:", "; ".join(map(str, unmet())) or "none")
EOF

step "models: the tiny demo model, and a random-init model of Qwen3-0.6B's shape"
if [ ! -f checkpoints/tiny-qwen3/config.json ]; then
  run "$PY" tools/make_tiny_model.py --out checkpoints/tiny-qwen3 --data-out checkpoints/arith
fi
SHAPE=/tmp/qwen3-0.6b-shape
run "$PY" tools/make_shape_model.py --shape qwen3-0.6b --out "$SHAPE" ${SHAPE_LAYERS:+--layers "$SHAPE_LAYERS"}

if [ "${FOCUS:-}" = decode ]; then  # FOCUS=decode: where a decode step's time goes (FOCUS_STEPS: which parts)
  FOCUS_STEPS=${FOCUS_STEPS:-attention target large512 small}
  has() { [[ " $FOCUS_STEPS " == *" $1 "* ]]; }
  if has attention; then
    step "decode attention of one layer: the group cache against cascade, per-row and groups of one, bf16"
    run "$PY" benchmarks/bench_decode_attention.py --device "$DEVICE" --dtype bfloat16 ${ATTENTION_SHAPES:+--shapes $ATTENTION_SHAPES}
  fi
  if has target; then
    step "rollout: the engine (groups, and rows) vs model.generate, $LARGE_PROMPTS x 8 x $LARGE_TOKENS, other prompts each run"
    run "$PY" benchmarks/bench_rollout.py --device "$DEVICE" --dtype bfloat16 --model "$SHAPE" --prompts "$LARGE_PROMPTS" \
      --n 8 --max-tokens "$LARGE_TOKENS" --repeats 1 --rollouts 1 --fresh-prompts --with-rows --no-cudnn-attention \
      --only engine-bf16,engine-bf16-rows,hf-bf16 ${ENGINE_SETTINGS:+--engine-settings "$ENGINE_SETTINGS"}
  fi
  if has large512; then
    step "the engine alone (groups, and rows), $LARGE_PROMPTS x 8 x $LARGE_TOKENS, max_batch_size 512 (one wave)"
    run "$PY" benchmarks/bench_rollout.py --device "$DEVICE" --dtype bfloat16 --model "$SHAPE" --prompts "$LARGE_PROMPTS" \
      --n 8 --max-tokens "$LARGE_TOKENS" --repeats 1 --rollouts 1 --fresh-prompts --with-rows \
      --only engine-bf16,engine-bf16-rows --engine-settings '{"max_batch_size": 512}'
  fi
  if has small; then
    step "profile: the engine alone, Qwen3-0.6B shape, bf16, $PROMPTS x 8 x $TOKENS"
    run "$PY" benchmarks/bench_rollout.py --device "$DEVICE" --dtype bfloat16 --model "$SHAPE" --prompts "$PROMPTS" --n 8 \
      --max-tokens "$TOKENS" --repeats 2 --rollouts 1 --full-warmup --fresh-prompts --only engine-bf16 --profile engine-bf16
  fi
  if has large; then  # one wave of the engine's default max_batch_size (256 rows), under the profiler
    step "profile: the engine alone, $((LARGE_PROMPTS / 2)) x 8 x $LARGE_TOKENS"
    run "$PY" benchmarks/bench_rollout.py --device "$DEVICE" --dtype bfloat16 --model "$SHAPE" --prompts $((LARGE_PROMPTS / 2)) \
      --n 8 --max-tokens "$LARGE_TOKENS" --repeats 1 --rollouts 1 --fresh-prompts --only engine-bf16 --profile engine-bf16
  fi
  step "done"; [ ${#failed[@]} -eq 0 ] || { printf 'failed: %s\n' "${failed[@]}"; exit 1; }; exit 0
fi

step "rollout: engine (CUDA graphs, and eager) vs model.generate and generate_batch, Qwen3-0.6B shape, $DTYPES"
run "$PY" benchmarks/bench_rollout.py --device "$DEVICE" --dtype "$DTYPES" --model "$SHAPE" --prompts "$PROMPTS" --n 8 \
  --max-tokens "$TOKENS" --repeats 3 --rollouts 1 --full-warmup --fresh-prompts --continuous-batching --without-graphs

if [ -z "${SKIP_LARGE:-}" ]; then
step "rollout: engine vs model.generate and generate_batch, Qwen3-0.6B shape, bf16, $LARGE_PROMPTS x 8 x $LARGE_TOKENS"
run "$PY" benchmarks/bench_rollout.py --device "$DEVICE" --dtype bfloat16 --model "$SHAPE" --prompts "$LARGE_PROMPTS" \
  --n 8 --max-tokens "$LARGE_TOKENS" --repeats 1 --rollouts 1 --fresh-prompts --continuous-batching --profile engine-bf16 \
  --no-cudnn-attention
fi

step "gpu-marked tests"
run "$PY" -m pytest -m gpu -q -rs -p no:cacheprovider tests

fit() {  # fit NAME STEPS ARGS...: an rlflow fit run on the demo config, its metrics.csv copied to $OUT/NAME.csv
  local name=$1 steps=$2; shift 2
  run "$PY" -m rlflow fit --config configs/demo_cpu.yaml --trainer.accelerator="$ACCELERATOR" \
    --trainer.max_steps="$steps" --trainer.logger.init_args.save_dir="runs/gpu_check_$name" \
    --model.export_hf=false --checkpoint.every_n_train_steps=0 --trainer.enable_progress_bar=false "$@"
  local csv
  csv=$(ls -t runs/gpu_check_"$name"/*/version_*/metrics.csv 2>/dev/null | head -1)
  [ -n "$csv" ] && cp "$csv" "$OUT/$name.csv" && "$PY" tools/summarize_run.py "$(dirname "$csv")" | tail -4
}

step "rlflow fit: the demo config, bf16-mixed (data.rollout: auto picks the backend and logs why; dtype auto), the rollout/training log-prob gap logged"
fit demo_bf16 "$STEPS" --trainer.precision=bf16-mixed --data.rollout=auto --model.rollout_correction.mode=token_truncate

step "rlflow fit: Qwen3-0.6B shape under FSDP2 with gradient checkpointing, packed, $FIT_TOKENS new tokens, a dense reward"
fit shape_fsdp2 "$SHAPE_STEPS" --model.model_path="$SHAPE" --data.global_batch_size="$SHAPE_PROMPTS" --trainer.strategy=fsdp2_bf16 \
  --trainer.precision=32-true --model.policy.gradient_checkpointing=true \
  --model.rollout_correction.mode=token_truncate --data.sampling.max_tokens="$FIT_TOKENS" --data.eval_data_path=null --model.optim.lr=1e-6 \
  '--data.judging.judgers={"*": "tests.integration.test_gpu:even_id_share"}'

if [ -z "${SKIP_FLOPS:-}" ]; then
step "achieved FLOP/s against the matmul peak, Qwen3-0.6B shape, bf16"
run "$PY" benchmarks/bench_flops.py --device "$DEVICE" --dtype bfloat16 --model "$SHAPE" --seqs "$PROMPTS" \
  --prompts "$PROMPTS" --n 8 --completion "$TOKENS" --repeats 2
fi

if [ -z "${SKIP_MORE:-}" ]; then
step "rollout: engine (CUDA graphs, and eager) vs model.generate and generate_batch, tiny model, float32 and bf16"
run "$PY" benchmarks/bench_rollout.py --device "$DEVICE" --dtype both --model checkpoints/tiny-qwen3 \
  --prompts "$PROMPTS" --n 8 --max-tokens 32 --repeats 3 --rollouts 3 --full-warmup --continuous-batching \
  --without-graphs

step "the engine's RMS norms in bf16: F.rms_norm (norm: torch, the default on a GPU) against the model's formula"
run "$PY" benchmarks/bench_norm.py --device "$DEVICE" --model "$SHAPE" --prompts "$PROMPTS" --n 8 \
  --max-tokens "$TOKENS" --repeats 3

step "rlflow fit: the demo config under FSDP2 (fsdp2_bf16, one rank)"
fit demo_fsdp2 "$STEPS" --trainer.strategy=fsdp2_bf16 --trainer.precision=32-true

step "rlflow fit: the demo config pipelined (max_staleness 1): a CUDA trainer, the generator process on CPU cores"
fit demo_pipelined "$STEPS" --data.pipeline.max_staleness=1 --data.pipeline.generator_threads=4
fi

step "done"
if [ ${#failed[@]} -gt 0 ]; then
  printf 'failed: %s\n' "${failed[@]}"
  exit 1
fi
echo "all steps passed"
