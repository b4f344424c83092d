#!/usr/bin/env bash
# The test command: set up (or reuse) the environment, then run the whole pytest suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k layers -x).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
# shellcheck disable=SC1091
. "${VENV:-.venv}/bin/activate"
python -m pytest -q "$@"
