#!/usr/bin/env bash
# Re-measure the figures the documentation shows, write them under docs/results/, and refresh
# the generated blocks of README.md and docs/*.md (scripts/render_docs.py).
#   scripts/regenerate_results.sh                 # everything (about 10 minutes on 2 CPU cores)
#   scripts/regenerate_results.sh bench comm      # only some: bench, comm, perf, precision, demo,
#                                                 # paper (the paper table's CPU dry run), ckpt,
#                                                 # optimizers, ledger, ledger-before,
#                                                 # ledger-time-before, bench-before
# `demo` runs scripts/demo.sh (set-up included: run it in a fresh clone to time a new user's
# first command) and keeps its key lines in docs/results/demo.txt.
# The CPU benchmark measures ratios side by side in one sitting; run it on a quiet machine.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/.."
activate() {  # the environment scripts/setup_env.sh made (demo.sh makes it itself)
  if [ ! -f "${VENV:-.venv}/bin/activate" ]; then
    echo "error: no environment at ${VENV:-.venv}; run scripts/setup_env.sh first (or name one with VENV=...)" >&2
    exit 2
  fi
  # shellcheck disable=SC1091
  . "${VENV:-.venv}/bin/activate"
}
out=docs/results
mkdir -p "$out"
what=${*:-bench comm perf precision ckpt ledger}

for item in $what; do
  [ "$item" = demo ] || activate
  case "$item" in
    bench)
      # Without recompute: full (the BOOST paper's baseline, no sequence parallelism), full+sp
      # (megatron's), naive, boost at TP=2 and the single-process row.
      python tools/benchmark.py --config configs/bench-cpu.yaml --tp 2 \
        --modes full,full+sp,full+swiglu,naive,boost --single --steps 10 --warmup 2 \
        --json "$out/bench-cpu-tp2.json" --png docs/bench-cpu-tp2.png
      # Right after, the bottleneck modes with low-rank activation checkpointing.
      python tools/benchmark.py --config configs/bench-cpu.yaml --tp 2 --modes naive,boost \
        --recompute lowrank --steps 6 --warmup 2 --json "$out/bench-cpu-tp2-lowrank.json"
      # The same modes again without recompute, for a back-to-back overhead comparison.
      python tools/benchmark.py --config configs/bench-cpu.yaml --tp 2 --modes naive,boost \
        --steps 6 --warmup 2 --json "$out/bench-cpu-tp2-norecompute.json" ;;
    comm)
      python tools/comm_volume.py --config configs/cola-7b.yaml --micro-batch-size 4 \
        --seq-length 4096 --dtype bf16 > "$out/comm-volume-cola-7b.txt" ;;
    perf)
      python tools/perf_model.py --compare-published > "$out/perf-model-published.txt" ;;
    paper)
      # The CPU dry run of the paper table (a GPU node writes the real one the same way).
      scripts/slurm/paper_table.sh --dry-run --json "$out/paper-table-cpu-dry-run.json" ;;
    ckpt)
      python tools/checkpoint_cost.py --scale 0.05 --file-mib 256 > "$out/checkpoint-cost.txt" ;;
    demo)
      scripts/demo.sh 2>&1 | tee /tmp/megatron-boost-demo.log
      # The key lines: the run's banner and budget, the last training line, each validation,
      # the summary, the sample, the export's check and the timing split.
      log=/tmp/megatron-boost-demo.log
      { grep -E '^megatron-boost:|^budget:' "$log"; grep -E '^iter ' "$log" | tail -1
        grep -E 'validation @|^done:|^summary:' "$log"
        sed -n '/sampling from the trained model/,/exporting it as/{/exporting it as/!p}' "$log"
        grep -E '^verification:|done in [0-9]+s' "$log"; } > "$out/demo.txt" ;;
    optimizers)
      # AdamW vs Muon on the demo corpus, each at its best of 3 or 4 learning rates, boost and
      # full rank: 13 training runs of the demo (about 40 minutes on 2 quiet CPU cores), then
      # the step times of all four side by side.
      scripts/demo_data.sh
      python scripts/compare_optimizers.py --out "$out/optimizers"  # optimizers.json, optimizers.txt
      python scripts/compare_optimizers.py --out "$out/optimizers" --timing-only --append ;;
    ledger)
      # The per-layer op ledger (docs/design.md §17) at the BOOST paper's 7B TP=4 and 1B TP=1
      # per-rank shapes, boost's forward all-reduces pipelined over 2 blocks, and boost's
      # interleaved halves of the micro-batch.
      python tools/layer_ops.py --config configs/paper-7b.yaml --modes full,full+sp,naive,boost \
        training.device=cpu --json "$out/layer-ops-paper-7b.json"
      python tools/layer_ops.py --config configs/paper-7b.yaml --modes boost --chunks 2 \
        training.device=cpu --json "$out/layer-ops-paper-7b-chunks2.json"
      python tools/layer_ops.py --config configs/paper-7b.yaml --modes boost --halves \
        training.device=cpu --json "$out/layer-ops-paper-7b-halves.json"
      python tools/layer_ops.py --config configs/paper-1b.yaml --tp 1 --modes full,naive,boost \
        training.device=cpu --json "$out/layer-ops-paper-1b-tp1.json" ;;
    ledger-time-before)
      # Freeze the 7B ledgers as they are now (run `ledger` first) as the "before" of
      # docs/performance.md's table in time; `ledger` alone then refreshes the "after".
      python -c 'import json, sys; json.dump([e for p in sys.argv[2:] for e in json.load(open(p))], open(sys.argv[1], "w"), indent=1)' \
        "$out/layer-ops-paper-7b-time-before.json" "$out/layer-ops-paper-7b.json" \
        "$out/layer-ops-paper-7b-chunks2.json" ;;
    bench-before)
      # This checkout's CPU benchmark against the layers before the lean boost step
      # (commit 5398f43), run in turn three times.
      python scripts/bench_against_commit.py --commit 5398f43 --runs 3 \
        --out "$out/bench-cpu-tp2-before-after.txt" ;;
    ledger-before)
      # The same ledgers of the layers as they were before the lean boost step (commit 5398f43:
      # online norm in eager fp32, fused-layout copies, megatron's unfused SwiGLU), measured by
      # this checkout's ledger: a worktree of that commit with the ledger's modules laid over.
      old=$(mktemp -d)
      trap 'git worktree remove --force "$old" >/dev/null 2>&1 || true' EXIT
      git worktree add --detach "$old" 5398f43 >/dev/null
      for f in megatron_boost/analysis megatron_boost/config megatron_boost/runtime/backends.py \
               megatron_boost/parallel/fusion.py megatron_boost/cli/layer_ops.py \
               megatron_boost/cli/arg_types.py megatron_boost/compat.py tools/layer_ops.py; do
        rm -rf "${old:?}/$f" && cp -r "$f" "$old/$f"
      done
      (cd "$old" && PYTHONPATH="$old" python tools/layer_ops.py --config configs/paper-7b.yaml \
         --modes full,full+sp,naive,boost training.device=cpu model.bias_activation_fusion=false \
         --json "$OLDPWD/$out/layer-ops-paper-7b-before.json" \
       && PYTHONPATH="$old" python tools/layer_ops.py --config configs/paper-1b.yaml --tp 1 \
         --modes full,naive,boost training.device=cpu model.bias_activation_fusion=false \
         --json "$OLDPWD/$out/layer-ops-paper-1b-tp1-before.json") ;;
    precision)
      python tools/precision_check.py --config configs/debug.yaml --tp 2 \
        > "$out/precision-debug-tp2.txt" ;;
    *) echo "error: unknown item '$item' (known: bench comm perf precision demo paper ckpt optimizers ledger ledger-before ledger-time-before bench-before)" >&2; exit 2 ;;
  esac
done
activate
python scripts/render_docs.py
