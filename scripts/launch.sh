#!/usr/bin/env bash
# Starts one trainer process (one per GPU) under any scheduler, or N of them on this machine.
#
#   scripts/launch.sh <config.yml> [key=value ...]             # one process; the scheduler started it
#   scripts/launch.sh --local N <config.yml> [key=value ...]   # N processes on this machine (coordinator on localhost)
#
# Under a scheduler, every process is started with the job's coordinator address, process count and its own
# id: COORDINATOR_ADDRESS / NUM_PROCESSES / PROCESS_ID (or the JAX_* spellings), and its local rank (which
# GPU of the machine is its own) in LOCAL_RANK. Under SLURM (srun) or Open MPI (mpirun) set none of them:
# jax.distributed finds the coordinator, the process ids and each process's GPU from the scheduler itself.
# The trainer calls jax.distributed.initialize() whenever the job has more than one process (MaxText/train.py).
#
# GPU environment (NVIDIA's recommendations for JAX training, see the README's "GPU node" section):
#   XLA_PYTHON_CLIENT_MEM_FRACTION=0.90   JAX may take 90% of HBM up front (the rest: NCCL, cuDNN workspaces)
#   CUDA_DEVICE_MAX_CONNECTIONS=1         Hopper (compute capability 9.x) only: one hardware queue keeps
#                                         compute and NCCL kernels in issue order, so collectives overlap as
#                                         scheduled; on Blackwell it is not wanted (NVIDIA: leave it unset)
#   NCCL_IB_SL=1                          InfiniBand service level used by NVIDIA's multi-node examples
#   NCCL_NVLS_ENABLE                      left to NCCL's default (NVLink SHARP where the fabric has it)
# Each is set only when not already set, so a user's value always wins.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"

if [ "${1:-}" = "--local" ]; then
    count="${2:?--local needs a process count}"
    shift 2
    port="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
    pids=()
    for ((i = 0; i < count; i++)); do
        COORDINATOR_ADDRESS="127.0.0.1:$port" NUM_PROCESSES="$count" PROCESS_ID="$i" LOCAL_RANK="$i" \
            "$0" "$@" &
        pids+=("$!")
    done
    status=0
    for pid in "${pids[@]}"; do
        wait "$pid" || status=$?
    done
    exit "$status"
fi

# The job's coordinator, size and this process's id, as the trainer passes them to jax.distributed.
if [ -n "${COORDINATOR_ADDRESS:-}" ]; then
    export JAX_COORDINATOR_ADDRESS="$COORDINATOR_ADDRESS" JAX_NUM_PROCESSES="${NUM_PROCESSES:?NUM_PROCESSES is not set}" \
        JAX_PROCESS_ID="${PROCESS_ID:?PROCESS_ID is not set}"
fi

if command -v nvidia-smi > /dev/null 2>&1 && nvidia-smi > /dev/null 2>&1; then
    # One process per GPU: each sees only its own (SLURM and Open MPI jobs: jax.distributed picks it).
    if [ -n "${LOCAL_RANK:-}" ] && [ -z "${CUDA_VISIBLE_DEVICES:-}" ]; then
        export CUDA_VISIBLE_DEVICES="$LOCAL_RANK"
    fi
    export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"
    export NCCL_IB_SL="${NCCL_IB_SL:-1}"
    major="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -n 1 | cut -d. -f1)"
    if [ "$major" = "9" ]; then
        export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
    fi
fi

# LAUNCH_MODULE: another entry point under the same launch (the GPU kit's NCCL EP check); default the trainer.
exec "$PYTHON" -m "${LAUNCH_MODULE:-MaxText.train}" "$@"
