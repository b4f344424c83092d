#!/usr/bin/env bash
# Readiness check of one CUDA GPU as stages (docs/gpu.md), each in its own process with its own
# time limit, rows printed as they are measured; exit status 1 when any stage failed.
#   tools/gpu_check.sh                 # on the GPU machine (deadline 470 s)
#   tools/gpu_check.sh --cpu           # the same stages on the CPU at tiny shapes
#   tools/gpu_check.sh --stages 0,3    # a selection
# What it runs: megatron_boost/cli/gpu_check.py. PYTHON selects the interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
# megatron-core orders its TP communication kernels with a single CUDA connection.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# The check keeps its own deadline; this outer limit only guards against a hung driver.
exec timeout --kill-after=10 600 "${PYTHON:-python}" -m megatron_boost.cli.gpu_check "$@"
