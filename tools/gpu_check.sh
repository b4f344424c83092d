#!/usr/bin/env bash
# Readiness check of one CUDA GPU in one command, one summary table (at most 8 minutes):
#   tools/gpu_check.sh          # on the GPU machine
#   tools/gpu_check.sh --cpu    # dry run of every step on the CPU with tiny shapes
# What it runs: megatron_boost/cli/gpu_check.py. PYTHON selects the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
# megatron-core orders its TP communication kernels with a single CUDA connection.
export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec timeout 480 "${PYTHON:-python}" -m megatron_boost.cli.gpu_check "$@"
