#!/usr/bin/env bash
# Validate a training job for the layout it asks for, then submit it with sbatch, so that a job
# which waited hours in the queue does not fail at start on a typo.
#
#   scripts/slurm/submit.sh [sbatch options] CONFIG [section.key=value ...]
#   e.g. scripts/slurm/submit.sh --nodes=2 --gpus-per-node=8 --time=24:00:00 \
#            configs/cola-1b.yaml parallel.tp=2 logging.run_dir=/shared/runs/cola-1b
#
# Before sbatch, on the login node (no GPU needed):
#   1. the layout: nodes (--nodes/-N) × processes per node (NPROC_PER_NODE, else the GPU count
#      of --gpus-per-node or --gres=gpu:N) gives the world size;
#   2. `pretrain_lowrank.py --check --world-size W --config CONFIG training.device=D overrides`:
#      the configuration (strict keys, types, divisibility of the layout), the data files
#      against the tokenizer, the output directories (writable), checkpoint.load/init_from;
#   3. logs/ is created (Slurm does not create the --output directory).
# An error is one line `error: ...` on stderr and exit status 2; nothing is submitted. Then
# `sbatch [sbatch options] scripts/slurm/pretrain.sbatch CONFIG [overrides]` (its output, with
# the job id, is printed). Run it from the repository root, on the shared filesystem the
# nodes see, inside the environment (or with PYTHON_ENV set, as pretrain.sbatch honours it).
#
# Also checked: the launcher's own settings (`pretrain.sbatch --check-settings`: SRUN_ARGS,
# GLOO_SOCKET_IFNAME, NPROC_PER_NODE) and that --cpus-per-task, when given, leaves each of the
# node's processes a CPU.
#
# Options that take a separate value are recognised (--nodes 2, -N 2, --time 1:00:00, ...);
# others must be written --option=value. Environment: NPROC_PER_NODE, MBOOST_DEVICE (default
# cuda; cpu for a CPU cluster), PYTHON_ENV, and everything pretrain.sbatch reads (SRUN_ARGS,
# TORCHRUN, the network settings).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
SBATCH_SCRIPT=scripts/slurm/pretrain.sbatch

fail() { echo "error: $*" >&2; exit 2; }

bash "$SBATCH_SCRIPT" --check-settings || exit 2

OPTS=()
NODES=1
GPUS=
CPUS_PER_TASK=
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do
    opt=$1; shift
    case "$opt" in
        -N|--nodes|--gpus-per-node|--gres|-t|--time|-p|--partition|-A|--account|-J|--job-name|\
        -o|--output|-e|--error|-q|--qos|-c|--cpus-per-task|--mem|-C|--constraint|-w|--nodelist|\
        --ntasks-per-node|--exclude|-x|--reservation|--dependency|-d|--mail-type|--mail-user)
            [ $# -gt 0 ] || fail "sbatch option $opt needs a value"
            val=$1; shift
            OPTS+=("$opt" "$val") ;;
        --*=*) opt_name=${opt%%=*}; val=${opt#*=}; OPTS+=("$opt") ;;
        -N*|-t*|-p*|-A*|-J*|-o*|-e*|-q*|-c*) opt_name=${opt:0:2}; val=${opt:2}; OPTS+=("$opt") ;;
        *) OPTS+=("$opt"); continue ;;
    esac
    case "${opt_name:-$opt}" in
        -N|--nodes)
            [ "$val" -gt 0 ] 2>/dev/null || fail "--nodes '$val' must be one positive number of nodes (a range min-max is not supported here)"
            NODES=$val ;;
        --gpus-per-node)
            n=${val##*:}
            [ "$n" -gt 0 ] 2>/dev/null || fail "--gpus-per-node '$val' must be N or TYPE:N with N > 0"
            GPUS=$n ;;
        -c|--cpus-per-task)
            [ "$val" -gt 0 ] 2>/dev/null || fail "--cpus-per-task '$val' must be a positive number of CPUs"
            CPUS_PER_TASK=$val ;;
        --gres)
            case "$val" in
                gpu:*) n=${val##*:}
                       [ "$n" -gt 0 ] 2>/dev/null || fail "--gres '$val' must be gpu:N or gpu:TYPE:N with N > 0"
                       GPUS=$n ;;
            esac ;;
    esac
    opt_name=
done
[ $# -ge 1 ] || { echo "usage: scripts/slurm/submit.sh [sbatch options] CONFIG [section.key=value ...]" >&2; exit 2; }
CONFIG=$1; shift
[ -f "$CONFIG" ] || fail "config '$CONFIG' does not exist (give a YAML run configuration, e.g. configs/cola-60m.yaml)"

DEVICE=${MBOOST_DEVICE:-cuda}
if [ -n "${NPROC_PER_NODE:-}" ]; then
    [ "$NPROC_PER_NODE" -gt 0 ] 2>/dev/null || fail "NPROC_PER_NODE '$NPROC_PER_NODE' must be a positive integer"
    NPROC=$NPROC_PER_NODE
elif [ -n "$GPUS" ]; then
    NPROC=$GPUS
elif [ "$DEVICE" = cpu ]; then
    NPROC=1   # pretrain.sbatch's default on a node without GPUs
else
    fail "no GPUs requested: give --gpus-per-node=N (or --gres=gpu:N), or MBOOST_DEVICE=cpu [NPROC_PER_NODE=N] for a CPU cluster"
fi
WORLD=$(( NODES * NPROC ))
if [ -n "$CPUS_PER_TASK" ] && [ "$CPUS_PER_TASK" -lt "$NPROC" ]; then
    fail "--cpus-per-task $CPUS_PER_TASK gives the node's $NPROC processes fewer than one CPU each (the launcher runs one task per node): ask for at least $NPROC, or omit it to get the allocation's CPUs"
fi

PY=python
if [ -n "${PYTHON_ENV:-}" ]; then
    [ -x "$PYTHON_ENV/bin/python" ] || fail "PYTHON_ENV '$PYTHON_ENV' has no bin/python"
    PY=$PYTHON_ENV/bin/python
fi
echo "submit.sh: checking $CONFIG for $NODES node(s) × $NPROC process(es) = world size $WORLD (training.device=$DEVICE)"
# The same overrides the job will get (pretrain.sbatch puts training.device first).
"$PY" pretrain_lowrank.py --check --world-size "$WORLD" --config "$CONFIG" \
    "training.device=$DEVICE" "$@" || exit 2
mkdir -p logs || fail "cannot create logs/ (Slurm writes the job's output there)"
command -v sbatch >/dev/null 2>&1 || fail "sbatch not found: run this on a Slurm login node"
exec sbatch "${OPTS[@]}" "$SBATCH_SCRIPT" "$CONFIG" "$@"
