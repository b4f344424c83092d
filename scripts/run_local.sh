#!/usr/bin/env bash
# Train on this machine: <nproc> processes (GPUs, or CPU processes with gloo), through the
# project's launcher (megatron_boost/cli/launch.py, installed as megatron-boost-train).
#
#   scripts/run_local.sh <nproc> <config.yaml> [section.key=value ...]
#   scripts/run_local.sh 2 configs/debug.yaml parallel.tp=2
#   NNODES=2 NODE_RANK=K RDZV_ENDPOINT=HOST0:29500 scripts/run_local.sh 8 cfg.yaml  # per node
#
# It validates the run first (a bad input: one `error:` line, exit status 2, nothing started),
# reports a rank's error in one line, and makes Ctrl-C / SIGTERM a pre-emption: the ranks save at
# the next step and it exits 0 (a second Ctrl-C stops at once, exit status 130). Relative paths
# in the configs (data/..., runs/...) are relative to the current directory. Uses the
# repository's .venv when no virtual environment is active (create it with
# scripts/setup_env.sh). One node: torchrun --standalone picks a free rendezvous port, so
# several local runs can coexist.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
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
NODES=()
if [ -n "${NNODES:-}" ]; then
    NODES=(--nnodes "$NNODES" --node-rank "${NODE_RANK:-0}")
    [ -n "${RDZV_ENDPOINT:-}" ] && NODES+=(--rdzv-endpoint "$RDZV_ENDPOINT")
fi
exec python -W ignore -m megatron_boost.cli.launch --nproc-per-node "$NPROC" "${NODES[@]}" \
    --config "$CONFIG" "$@"
