#!/usr/bin/env bash
# Validate a training job for the layout it asks for, then submit it with sbatch, so that a job
# which waited hours in the queue does not fail at start on a typo. `--help` prints the options
# and the environment it reads (usage() below); `--dry-run` does every check and prints what
# would be submitted and what each node would run, without calling sbatch.
#
# Before sbatch, on the login node (no GPU needed):
#   1. the layout: nodes (--nodes/-N) × processes per node (NPROC_PER_NODE, else the GPU count
#      of --gpus-per-node or --gres=gpu:N) gives the world size;
#   2. `pretrain_lowrank.py --check --world-size W --config CONFIG training.device=D overrides`:
#      the configuration (strict keys, types, divisibility of the layout), the data files
#      against the tokenizer, the output directories (writable), checkpoint.load/init_from;
#   3. the pre-emption signal's lead time against one rank's estimated checkpoint save
#      (`tools/checkpoint_cost.py --estimate`): without --signal the job is submitted with
#      --signal=B:USR1@<lead> (at least pretrain.sbatch's 180 s); a shorter --signal given
#      here is kept, with one `warning:` line;
#   4. logs/ is created (Slurm does not create the --output directory).
# An error is one line `error: ...` on stderr and exit status 2; nothing is submitted. Then
# `sbatch --signal=... [sbatch options] scripts/slurm/pretrain.sbatch CONFIG [overrides]` (its
# output, with the job id, is printed). Run it from the repository root, on the shared
# filesystem the nodes see, inside the environment (or with PYTHON_ENV set).
#
# Also checked: the launcher's own settings (`pretrain.sbatch --check-settings`: SRUN_ARGS,
# GLOO_SOCKET_IFNAME, TORCHRUN, NPROC_PER_NODE) and that --cpus-per-task, when given, leaves
# each of the node's processes a CPU.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 2
SBATCH_SCRIPT=scripts/slurm/pretrain.sbatch

fail() { echo "error: $*" >&2; exit 2; }

usage() {
    cat <<'USAGE'
usage: scripts/slurm/submit.sh [--dry-run] [sbatch options] CONFIG [section.key=value ...]

Checks a training job on the login node (the launcher's settings, the configuration and its
data for the requested layout, the pre-emption signal's lead time against the estimated
checkpoint save), then submits scripts/slurm/pretrain.sbatch with sbatch. A failed check is
one `error: ...` line, exit status 2, and nothing is submitted. Run it from the repository
root, on the file system the nodes see.

  --dry-run          check everything, print the sbatch command and what each node would run
                     (the srun step, the launcher's command, the environment it sets); exit 0
                     without calling sbatch
  -h, --help         this text
  sbatch options     passed to sbatch as given; --nodes/-N, --gpus-per-node, --gres=gpu:N and
                     --cpus-per-task/-c are read for the layout and the CPU check, --signal for
                     the lead-time check (without it: --signal=B:USR1@<lead> from the save
                     estimate, at least 180 s). Options taking a separate value are recognised
                     (--nodes 2, -N 2, --time 1:00:00, ...); others must be --option=value.
  CONFIG [overrides] the run configuration (YAML) and section.key=value overrides, as for
                     pretrain_lowrank.py

Environment (read here and by the job; sbatch exports the submitting environment):
  NPROC_PER_NODE     processes per node (default: the GPUs requested; 1 without GPUs)
  MBOOST_DEVICE      the trainer's device, the first override training.device=... (default
                     cuda; cpu for a CPU cluster)
  PYTHON_ENV         a virtual environment: its python checks here, the job activates it
  SRUN_ARGS          extra srun arguments of the training step, split at spaces (containers:
                     --container-image=...); --nodes/--ntasks are the launcher's and refused
  TORCHRUN           how torchrun is started, ending in torchrun or -m torch.distributed.run
                     (e.g. "apptainer exec --nv image.sif torchrun"); the job runs the
                     project's launcher in its place, with the same words before it
  CKPT_WRITE_MIB_S   one rank's write rate to the checkpoint file system in MiB/s, for the
                     save estimate (default: the slow disk docs/fault-tolerance.md measured;
                     measure yours with tools/checkpoint_cost.py --dir <that file system>)
  PRETRAIN_SCRIPT    the job's entry point (default: pretrain_lowrank.py of the submit dir)
  MASTER_PORT        rendezvous port (default: 20000 + job id % 10000)
  OMP_NUM_THREADS    default: the step's CPUs per node / processes per node
  CUDA_DEVICE_MAX_CONNECTIONS     default 1 (megatron's ordering of overlapped TP traffic)
  TORCH_ELASTIC_SHUTDOWN_TIMEOUT  seconds torchrun gives its ranks to stop (default 150)
  REQUEUE_ON_PREEMPT 1 (default): requeue after the pre-emption signal's checkpoint; 0: stop
  Network settings, exported to every rank and logged: NCCL_SOCKET_IFNAME,
  GLOO_SOCKET_IFNAME (interface names only), NCCL_IB_HCA, NCCL_IB_DISABLE, NCCL_IB_GID_INDEX,
  NCCL_NET, NCCL_CROSS_NIC, NCCL_SOCKET_FAMILY, NCCL_DEBUG, UCX_NET_DEVICES, FI_PROVIDER,
  FI_EFA_USE_DEVICE_RDMA.
Details: the header of scripts/slurm/pretrain.sbatch.
USAGE
}

OPTS=()
NODES=1
GPUS=
CPUS_PER_TASK=
SIGNAL_LEAD=
DRY_RUN=0
while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do
    opt=$1; shift
    case "$opt" in
        -h|--help) usage; exit 0 ;;
        --dry-run) DRY_RUN=1; continue ;;
        -N|--nodes|--gpus-per-node|--gres|-t|--time|-p|--partition|-A|--account|-J|--job-name|\
        -o|--output|-e|--error|-q|--qos|-c|--cpus-per-task|--mem|-C|--constraint|-w|--nodelist|\
        --ntasks-per-node|--exclude|-x|--reservation|--dependency|-d|--mail-type|--mail-user|\
        --signal)
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
        --signal)
            SIGNAL_LEAD=60   # [{R|B}:]SIG[@TIME]: Slurm's lead time is 60 s without @TIME
            case "$val" in *@*) SIGNAL_LEAD=${val##*@} ;; esac
            [ "$SIGNAL_LEAD" -ge 0 ] 2>/dev/null || fail "--signal '$val' must be [B:]SIG[@SECONDS], e.g. B:USR1@300" ;;
        --gres)
            case "$val" in
                gpu:*) n=${val##*:}
                       [ "$n" -gt 0 ] 2>/dev/null || fail "--gres '$val' must be gpu:N or gpu:TYPE:N with N > 0"
                       GPUS=$n ;;
            esac ;;
    esac
    opt_name=
done
[ $# -ge 1 ] || { echo "usage: scripts/slurm/submit.sh [--dry-run] [sbatch options] CONFIG [section.key=value ...] (--help: every option)" >&2; exit 2; }
CONFIG=$1; shift
bash "$SBATCH_SCRIPT" --check-settings || exit 2
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

# The pre-emption signal's lead time must leave one rank's checkpoint save time to finish.
estimate=$("$PY" tools/checkpoint_cost.py --estimate "$CONFIG" \
    "training.device=$DEVICE" "$@" ${CKPT_WRITE_MIB_S:+--write-mib-s "$CKPT_WRITE_MIB_S"}) || exit 2
[[ "$estimate" =~ ^estimated\ save\ ([0-9]+)\ s\ \((.*)\):\ signal\ lead\ time\ ([0-9]+)\ s$ ]] \
    || fail "unexpected checkpoint estimate '$estimate' from tools/checkpoint_cost.py"
SAVE_S=${BASH_REMATCH[1]}
SAVE_WHY=${BASH_REMATCH[2]}
LEAD_S=${BASH_REMATCH[3]}
if [ -z "$SIGNAL_LEAD" ]; then
    OPTS=("--signal=B:USR1@$LEAD_S" "${OPTS[@]}")
    echo "submit.sh: estimated checkpoint save $SAVE_S s ($SAVE_WHY; CKPT_WRITE_MIB_S sets the rate): submitting with --signal=B:USR1@$LEAD_S"
elif [ "$SIGNAL_LEAD" -lt "$SAVE_S" ]; then
    echo "warning: --signal lead time $SIGNAL_LEAD s is shorter than the estimated checkpoint save $SAVE_S s ($SAVE_WHY): the time limit or a pre-emption may kill the save (the previous checkpoint stays in force); give --signal=B:USR1@$LEAD_S, or set CKPT_WRITE_MIB_S to your file system's rate (tools/checkpoint_cost.py measures it)" >&2
fi

if [ "$DRY_RUN" = 1 ]; then
    echo "submit.sh: dry run, nothing submitted; the submission:"
    printf '  sbatch'; printf ' %q' "${OPTS[@]}" "$SBATCH_SCRIPT" "$CONFIG" "$@"; echo
    echo "submit.sh: what the job runs on each of its $NODES node(s) (<...>: known once Slurm starts it):"
    # pretrain.sbatch resolves the launch as it will in the job, for the allocation this
    # request asks for, and prints it instead of starting the step.
    env -u SLURM_JOB_ID MBOOST_DRY_RUN=1 SLURM_SUBMIT_DIR="$PWD" SLURM_JOB_NUM_NODES="$NODES" \
        SLURM_GPUS_ON_NODE="${GPUS:-0}" ${CPUS_PER_TASK:+SLURM_CPUS_PER_TASK=$CPUS_PER_TASK} \
        NPROC_PER_NODE="$NPROC" bash "$SBATCH_SCRIPT" "$CONFIG" "$@" || exit 2
    exit 0
fi
mkdir -p logs || fail "cannot create logs/ (Slurm writes the job's output there)"
command -v sbatch >/dev/null 2>&1 || fail "sbatch not found: run this on a Slurm login node"
exec sbatch "${OPTS[@]}" "$SBATCH_SCRIPT" "$CONFIG" "$@"
