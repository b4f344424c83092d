#!/usr/bin/env bash
# Train the three tensor-parallel twins of one config and plot them together:
#   full  - the full-rank model of the same shape (megatron-core's own TP; ranks ignored)
#   naive - the bottleneck model with vanilla TP
#   boost - the bottleneck model with BOOST's bottleneck-aware TP
#
#   scripts/compare_modes.sh <config.yaml> [section.key=value ...]
#   scripts/compare_modes.sh configs/debug.yaml parallel.tp=2 training.train_iters=50
#
# Run directories: <run_dir>-full, <run_dir>-naive, <run_dir>-boost (run_dir = the config's
# logging.run_dir after the overrides); the figure: <run_dir>-modes.png (tools/plot_runs.py),
# and a summary table on stdout (tools/summarize_run.py --table). Processes per run: $NPROC,
# default tp × pp × (dp or 1) of the config. A run directory that already holds a checkpoint is resumed (finished runs are not
# repeated); FRESH=1 deletes the three run directories first.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
if [ $# -lt 1 ]; then
    echo "compare_modes.sh: error: no config given; usage: scripts/compare_modes.sh <config.yaml> [section.key=value ...]" >&2
    exit 2
fi
CONFIG=$1
shift
# shellcheck source=scripts/launch_env.sh
. "$ROOT/scripts/launch_env.sh"
# logging.run_dir and the process count, from the config with the overrides applied
read -r RUN_DIR WORLD < <(python -W ignore - "$CONFIG" "$@" <<'PY'
import sys
from megatron_boost.config.run import load_run_config
try:
    cfg = load_run_config(sys.argv[1], sys.argv[2:])
except ValueError as err:
    print(f"compare_modes.sh: error: {err}", file=sys.stderr)
    sys.exit(2)
p = cfg.parallel
print(cfg.logging.run_dir.rstrip("/"), p.tp * p.pp * (p.dp or 1))
PY
) || true
[ -n "${RUN_DIR:-}" ] || exit 2  # the configuration's error was printed above
NPROC=${NPROC:-$WORLD}
MODES=(full naive boost)
for mode in "${MODES[@]}"; do
    dir="$RUN_DIR-$mode"
    if [ "${FRESH:-0}" = 1 ]; then rm -rf "$dir"; fi
    echo "=== $mode: $dir ($NPROC processes)"
    "$ROOT/scripts/run_local.sh" "$NPROC" "$CONFIG" "$@" "parallel.mode=$mode" \
        "logging.run_dir=$dir"
done
python "$ROOT/tools/plot_runs.py" "${MODES[@]/#/$RUN_DIR-}" --labels "${MODES[@]}" \
    --out "$RUN_DIR-modes.png" --title "$(basename "$CONFIG"): full vs naive vs boost"
python "$ROOT/tools/summarize_run.py" --table "${MODES[@]/#/$RUN_DIR-}" --labels "${MODES[@]}"
