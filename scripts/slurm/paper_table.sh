#!/usr/bin/env bash
# The BOOST paper's iteration-time table on this node's GPUs: full, naive and boost back to back
# for each row (1B, 1B-tp4, 3B, 7B, 13B; configs/paper-*.yaml), synthetic data, one table with
# the published A100 figures and the performance model's prediction beside the measurements.
#
#   sbatch --nodes=1 --gpus-per-node=8 --time=1:00:00 --output=logs/%j.out \
#       scripts/slurm/paper_table.sh [--rows 3B,7B | all] [--json runs/paper-table.json]
#   scripts/slurm/paper_table.sh --rows 7B                 # on an interactive GPU node
#   scripts/slurm/paper_table.sh --dry-run                 # CPU, tiny shapes, 2 processes
#
# Submit from the repository root (Slurm runs a copy of this file from its spool directory).
# Thin on purpose: the environment (scripts/launch_env.sh; PYTHON_ENV, a virtual environment
# to activate, as pretrain.sbatch honours it), then tools/paper_table.py with the arguments;
# that tool launches one torchrun per world size (TORCHRUN overrides the launcher command,
# MBOOST_GPUS the GPU count it detects). `--help` lists its options.
set -uo pipefail
# The repository: the submit directory under sbatch, else this file's; when the submit directory
# is not the repository (submitted from elsewhere), this file's own checkout if it is one (a
# direct run), else one error line (sbatch ran a spool copy: nothing to find the checkout by).
HERE=$(cd "$(dirname "$0")/../.." 2>/dev/null && pwd)
ROOT=${SLURM_SUBMIT_DIR:-$HERE}
if [ ! -f "$ROOT/tools/paper_table.py" ]; then
    if [ -n "$HERE" ] && [ -f "$HERE/tools/paper_table.py" ]; then
        ROOT=$HERE
    else
        echo "error: $ROOT is not the megatron-boost repository (no tools/paper_table.py): submit from the repository root (cd there, then sbatch scripts/slurm/paper_table.sh)" >&2
        exit 2
    fi
fi
cd "$ROOT" || { echo "error: cannot enter the repository root $ROOT" >&2; exit 2; }
if [ -n "${PYTHON_ENV:-}" ]; then
    # shellcheck disable=SC1091
    . "$PYTHON_ENV/bin/activate" || { echo "error: PYTHON_ENV=$PYTHON_ENV has no bin/activate; set it to a virtual environment" >&2; exit 2; }
fi
# shellcheck disable=SC1091
. scripts/launch_env.sh
exec python tools/paper_table.py "$@"
