#!/usr/bin/env bash
# The compatibility tier (docs/design.md §14): the newest supported stack, Python 3.12 +
# megatron-core 0.19.2 + torch 2.14.1, built (or reused) in .venv312 by scripts/setup_env.sh,
# then the tests that prove megatron-boost on it. .ci/run runs it after scripts/test.sh (the
# whole suite on the primary 3.11 / 0.16.1 / torch 2.13 CPU environment).
#
#   scripts/test_compat.sh [extra pytest arguments]
#
# Environment: COMPAT_VENV (.venv312), COMPAT_PYTHON (python3.12, found through pyenv when not
# on PATH), COMPAT_MCORE (0.19.2), COMPAT_TORCH (2.14.1).
#
# torch for Python 3.12 comes from PyPI, whose Linux torch wheels are CUDA builds (about
# 2.6 GB with their CUDA libraries; they run on the CPU too): hence --cuda, on purpose, since
# the CPU wheel index is not reachable from every CI machine. The measured times are in
# docs/design.md §14.
set -euo pipefail
cd "$(dirname "$0")/.."
export VENV=${COMPAT_VENV:-.venv312}
PYTHON=${COMPAT_PYTHON:-python3.12} MCORE=${COMPAT_MCORE:-0.19.2} TORCH=${COMPAT_TORCH:-2.14.1} \
  EXTRAS=test,convert scripts/setup_env.sh --cuda
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m megatron_boost  # the versions under test, in the CI log (exit 1 outside the range)

# Explicit test ids: a renamed test is an error here (pytest exit 4), not a silent gap.
TESTS=(
  # the version differences themselves
  tests/test_compat.py
  # layer equivalence: each bottleneck layer against its dense reference, TP=1/2/4
  tests/test_layers.py::test_layer_matches_reference_fp32
  tests/test_layers.py::test_negative_control_wrong_shard_is_caught
  # layout equivalence: every TP/PP/DP layout against one process, and its negative controls
  tests/test_parallel.py::test_layout_equals_one_process
  tests/test_parallel.py::test_negative_control_is_caught
  # TP=2 train -> save -> resume bit-exactly (distributed optimizer), and kill -> relaunch,
  # with the synchronous and the asynchronous save
  tests/test_training.py::test_end_to_end_metrics_and_checkpoint
  tests/test_training.py::test_resume_reproduces_uninterrupted_run_exactly
  "tests/test_fault_tolerance.py::test_killed_rank_relaunch_reproduces_losses[after_iteration-False]"
  "tests/test_fault_tolerance.py::test_killed_rank_relaunch_reproduces_losses[during_save-True]"
  # export -> HF logits equal; import
  tests/test_convert.py::test_hf_model_reproduces_megatron_and_catches_a_transposed_weight
  tests/test_convert.py::test_import_full_rank_is_exact
  tests/test_convert.py::test_import_low_rank_reports_the_svd_tail_energy
  tests/test_convert.py::test_export_import_round_trip_is_bit_exact
)
status=0
python -m pytest -q -p no:cacheprovider "${TESTS[@]}" "$@" || status=$?
if [ "$status" = 5 ]; then
  echo "test_compat.sh: error: pytest collected no tests (exit 5); the compatibility tier" \
    "must run its list" >&2
  exit 1
fi
exit "$status"
