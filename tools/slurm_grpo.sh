#!/bin/bash
# Multi-node GRPO with rlflow on SLURM: one task per GPU, Lightning reads the SLURM environment.
#
#   sbatch --nodes=2 tools/slurm_grpo.sh configs/grpo_gsm8k_qwen3_8b_lmdeploy.yaml --model.model_path /models/Qwen3-8B
#
# srun starts ${SLURM_NTASKS_PER_NODE} processes per node; Lightning's SLURMEnvironment takes the ranks, the
# world size and the rendezvous (MASTER_ADDR/MASTER_PORT) from SLURM, so trainer.num_nodes and trainer.devices
# must agree with the allocation (they are passed below). FSDP2 shards over all nodes x GPUs; with the lmdeploy
# backend every GPU also runs its own colocated engine (tp 1) on 127.0.0.1, port 23333 + local rank.
# Keep data.global_batch_size a multiple of nodes x GPUs. Extra arguments go to `rlflow fit`.
#SBATCH --job-name=rlflow-grpo
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --mem=0
#SBATCH --time=48:00:00
#SBATCH --output=logs/%x-%j.out

set -euo pipefail
CONFIG=${1:?usage: sbatch tools/slurm_grpo.sh CONFIG.yaml [rlflow fit arguments...]}
shift

GPUS_PER_NODE=${SLURM_GPUS_PER_NODE:-8}
GPUS_PER_NODE=${GPUS_PER_NODE##*:}   # "h100:8" -> "8"
NODES=${SLURM_JOB_NUM_NODES:-1}
mkdir -p logs

# Rendezvous on the first node (Lightning's SLURMEnvironment also derives these; exporting them is harmless).
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
export TOKENIZERS_PARALLELISM=false
export NCCL_ASYNC_ERROR_HANDLING=1

echo "[rlflow] ${NODES} node(s) x ${GPUS_PER_NODE} GPU(s), master ${MASTER_ADDR}:${MASTER_PORT}, config ${CONFIG}"

srun --kill-on-bad-exit=1 rlflow fit \
    --config "${CONFIG}" \
    --trainer.num_nodes="${NODES}" \
    --trainer.devices="${GPUS_PER_NODE}" \
    "$@"
