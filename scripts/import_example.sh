#!/usr/bin/env bash
# The worked import example of docs/import-example.md: how much of a trained full-rank model a
# CoLA import keeps, in validation perplexity on the demo's held-out plays.
#
#   scripts/import_example.sh            (inside the environment; writes docs/import-example.json)
#
#   1. the demo's data (scripts/demo_data.sh)
#   2. train the full-rank twin of configs/demo-shakespeare.yaml (parallel.mode=full) for
#      FULL_ITERS iterations, one process on the CPU, and export it (tools/export_hf.py)
#   3. import the export into CoLA at the demo's rank (64) with σ = identity
#      (tools/import_hf.py: truncated SVD of every projection; the export's own tokenizer)
#   4. continue training the import for CONT_ITERS iterations (its train.yaml:
#      checkpoint.init_from), and, for comparison, train the same CoLA model from scratch for
#      CONT_ITERS iterations
#   5. validation perplexity (tools/evaluate.py on the first EVAL_BYTES bytes of the held-out
#      plays, i.e. the opening of Hamlet) of the full-rank model, the import, the continued import
#      and the CoLA model from scratch -> docs/import-example.json
# Sized to run in minutes on a 2-core CPU: a global batch of 8 (the demo: 16), 100 + 30
# iterations, an evaluation excerpt of about 15k tokens.
#
# Environment: FULL_ITERS (100), CONT_ITERS (30), EVAL_BYTES (50000), DEMO_DATA
# (data/shakespeare), OUT (runs/import-example; removed first), RESULT (docs/import-example.json).
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
if [ $# -gt 0 ]; then
    echo "import_example.sh: error: unknown argument '$1'; it takes none (settings are the environment variables above; see --help)" >&2
    exit 2
fi
set -euo pipefail
cd "$(dirname "$0")/.."
FULL_ITERS=${FULL_ITERS:-100}
CONT_ITERS=${CONT_ITERS:-30}
DATA=${DEMO_DATA:-data/shakespeare}
OUT=${OUT:-runs/import-example}
RESULT=${RESULT:-docs/import-example.json}
EVAL_BYTES=${EVAL_BYTES:-50000}
CONFIG=configs/demo-shakespeare.yaml
START=$(date +%s)
say() { echo "[import-example $(( $(date +%s) - START ))s] $*"; }

DEMO_START=$START scripts/demo_data.sh "$DATA"
rm -rf "$OUT"
mkdir -p "$OUT"
head -c "$EVAL_BYTES" "$DATA/valid.txt" > "$OUT/valid-excerpt.txt"
# One process, TP=1 (the import's checkpoint reshards to any layout; the CPU has 2 cores).
DATA_ARGS=("data.data_path=[$DATA/train_text_document]" "data.valid_data_path=[$DATA/valid_text_document]")
LAYOUT=(parallel.tp=1 training.device=cpu training.micro_batch_size=8 training.global_batch_size=8
        training.eval_iters=2)
# Continued training starts from a trained model: a shorter warmup and a lower peak than the
# demo's from-scratch schedule (the same for the from-scratch comparison).
CONT_OPT=(optimizer.lr=1.0e-3 optimizer.min_lr=1.0e-4 optimizer.warmup_iters=10)
evaluate() {  # <model> <name>
    python -W ignore tools/evaluate.py "$1" --input "$OUT/valid-excerpt.txt" --json "$OUT/eval-$2.json" 2>&1 \
        | grep -v "it/s\]" || true
    [ -f "$OUT/eval-$2.json" ] || { echo "import_example.sh: error: evaluating $1 failed" >&2; exit 1; }
}

say "1/5 training the full-rank twin ($FULL_ITERS iterations)"
python -W ignore pretrain_lowrank.py --config "$CONFIG" parallel.mode=full "${LAYOUT[@]}" \
    "${DATA_ARGS[@]}" "data.tokenizer_model=$DATA/tokenizer.model" \
    "training.train_iters=$FULL_ITERS" "training.eval_interval=$FULL_ITERS" \
    "logging.run_dir=$OUT/full" logging.tensorboard=false
python -W ignore tools/export_hf.py "$OUT/full/checkpoints" "$OUT/full-hf"

say "2/5 importing it into CoLA, rank 64, σ = identity"
python -W ignore tools/import_hf.py "$OUT/full-hf" "$OUT/imported" --config "$CONFIG" \
    model.bottleneck_activation=identity model.mlp_gate_activation=false "${LAYOUT[@]}" \
    "${DATA_ARGS[@]}" 2>&1 | tee "$OUT/import.log" | grep -v "it/s\]"

say "3/5 continuing to train the import ($CONT_ITERS iterations, checkpoint.init_from)"
python -W ignore pretrain_lowrank.py --config "$OUT/imported/train.yaml" "${CONT_OPT[@]}" \
    "training.train_iters=$CONT_ITERS" "training.eval_interval=$CONT_ITERS" \
    "logging.run_dir=$OUT/continued" logging.tensorboard=false

say "4/5 the same CoLA model from scratch ($CONT_ITERS iterations)"
python -W ignore pretrain_lowrank.py --config "$CONFIG" model.bottleneck_activation=identity \
    model.mlp_gate_activation=false "${LAYOUT[@]}" "${DATA_ARGS[@]}" \
    "data.tokenizer_model=$DATA/tokenizer.model" "${CONT_OPT[@]}" \
    "training.train_iters=$CONT_ITERS" "training.eval_interval=$CONT_ITERS" \
    "logging.run_dir=$OUT/scratch" logging.tensorboard=false

say "5/5 validation perplexity on the held-out plays"
evaluate "$OUT/full/checkpoints" full
evaluate "$OUT/imported" imported
evaluate "$OUT/continued/checkpoints" continued
evaluate "$OUT/scratch/checkpoints" scratch

python - "$OUT" "$RESULT" "$FULL_ITERS" "$CONT_ITERS" "$(( $(date +%s) - START ))" "$EVAL_BYTES" <<'PY'
import json, re, sys
out, result, full_iters, cont_iters, seconds = sys.argv[1:6]
ev = {k: json.load(open(f"{out}/eval-{k}.json")) for k in ("full", "imported", "continued", "scratch")}
errors = [float(x) for line in open(f"{out}/import.log") if re.match(r"\s+\d+ ", line)
          for x in line.split()[1:]]
doc = {
    "command": "scripts/import_example.sh",
    "setting": "configs/demo-shakespeare.yaml (4 layers, d=256, f=688, vocab 4000, seq 128) "
               "at a global batch of 8, one CPU process; validation: tools/evaluate.py on the "
               "first EVAL_BYTES bytes of the held-out plays (the opening of Hamlet)",
    "eval_bytes": int(sys.argv[6]),
    "full_rank_iterations": int(full_iters),
    "import": "parallel.mode=boost, attn_rank=mlp_rank=64, bottleneck_activation=identity, "
              "mlp_gate_activation=false (truncated SVD of every projection)",
    "continued_iterations": int(cont_iters),
    "continued_optimizer": "lr 1.0e-3 -> 1.0e-4 (cosine), warmup 10",
    "svd_relative_error": {"min": min(errors), "max": max(errors),
                           "mean": sum(errors) / len(errors)},
    "validation_tokens": ev["full"]["tokens"],
    "perplexity": {
        "full_rank_trained": ev["full"]["perplexity"],
        "cola_imported": ev["imported"]["perplexity"],
        "cola_imported_then_trained": ev["continued"]["perplexity"],
        "cola_from_scratch_same_iterations": ev["scratch"]["perplexity"],
    },
    "wall_seconds": int(seconds),
}
open(result, "w").write(json.dumps(doc, indent=1) + "\n")
print(json.dumps(doc["perplexity"], indent=1))
PY
say "done: $RESULT"
