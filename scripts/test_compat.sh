#!/usr/bin/env bash
# The compatibility tier (docs/design.md §15): the newest supported stack, Python 3.12 +
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
# docs/design.md §15.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
if ! [[ "${TEST_WORKERS:-2}" =~ ^([0-9]+|auto|logical)$ ]]; then  # before any install
    echo "test_compat.sh: error: TEST_WORKERS='${TEST_WORKERS}' is not a number of pytest-xdist workers (a count, auto or logical; 0 runs in one process)" >&2
    exit 2
fi
set -euo pipefail
cd "$(dirname "$0")/.."
export VENV=${COMPAT_VENV:-.venv312}
PYTHON=${COMPAT_PYTHON:-python3.12} MCORE=${COMPAT_MCORE:-0.19.2} TORCH=${COMPAT_TORCH:-2.14.1} \
  EXTRAS=test,convert scripts/setup_env.sh --cuda
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m megatron_boost  # the versions under test, in the CI log (exit 1 outside the range)

# The tests marked `compat` (docs/testing.md): the version differences themselves
# (tests/test_compat.py), layer and layout equivalence, the TP=2 resume with identical losses,
# kill -> relaunch with synchronous and asynchronous saves, export -> HF logits and import.
status=0
unset PYTHONDONTWRITEBYTECODE  # compile the package once for the tier's many processes
python -m pytest -q -n "${TEST_WORKERS:-2}" -p no:cacheprovider -m compat "$@" || status=$?
if [ "$status" = 5 ]; then
  echo "test_compat.sh: error: pytest collected no tests (exit 5); the compatibility tier" \
    "must run the compat-marked tests" >&2
  exit 1
fi
exit "$status"
