#!/usr/bin/env bash
# Train on this machine: torchrun with <nproc> processes (GPUs, or CPU processes with gloo).
#
#   scripts/run_local.sh <nproc> <config.yaml> [section.key=value ...]
#   scripts/run_local.sh 2 configs/debug.yaml parallel.tp=2
#
# Run it from the repository root: relative paths in the configs (data/..., runs/...) are
# relative to the current directory. Uses the repository's .venv when no virtual environment is
# active (create it with scripts/setup_env.sh). torchrun --standalone picks a free rendezvous
# port, so several local runs can coexist. Extra torchrun options: TORCHRUN_ARGS="...".
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [ $# -lt 2 ]; then
    echo "usage: scripts/run_local.sh <nproc> <config.yaml> [section.key=value ...]" >&2
    exit 2
fi
NPROC=$1
CONFIG=$2
shift 2
if ! [ "$NPROC" -ge 1 ] 2>/dev/null; then
    echo "run_local.sh: error: <nproc> must be a positive integer, got '$NPROC'" >&2
    exit 2
fi
if [ ! -f "$CONFIG" ]; then
    echo "run_local.sh: error: config file '$CONFIG' does not exist" >&2
    exit 2
fi
# shellcheck source=scripts/launch_env.sh
. "$ROOT/scripts/launch_env.sh"
# Validate first, in one process: a bad input ends in the trainer's one error line (exit 2)
# instead of torchrun's failure report.
python -W ignore "$ROOT/pretrain_lowrank.py" --check --world-size "$NPROC" --config "$CONFIG" "$@" \
    || exit $?
# shellcheck disable=SC2086
exec torchrun --standalone --nproc_per_node="$NPROC" ${TORCHRUN_ARGS:-} \
    "$ROOT/pretrain_lowrank.py" --config "$CONFIG" "$@"
