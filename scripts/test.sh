#!/usr/bin/env bash
# The test command: set up (or reuse) the environment, then run the pytest suite.
#   scripts/test.sh          everything (CI)
#   scripts/test.sh --fast   the fast tier only (pytest -m fast; docs/testing.md)
# Extra arguments go to pytest (e.g. scripts/test.sh -k layers -x; -n 0 runs in one process).
# Tests run in TEST_WORKERS pytest-xdist workers (default 2: one per core of the 2-core machine
# the budgets are set on; tests/conftest.py says how files are shared out).
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
if ! [[ "${TEST_WORKERS:-2}" =~ ^([0-9]+|auto|logical)$ ]]; then  # before any install
    echo "test.sh: error: TEST_WORKERS='${TEST_WORKERS}' is not a number of pytest-xdist workers (a count, auto or logical; 0 runs in one process)" >&2
    exit 2
fi
set -euo pipefail
tier=()
if [ "${1:-}" = "--fast" ]; then
  shift
  tier=(-m fast)
fi
cd "$(dirname "$0")/.."
# The suite needs every extra: pytest, matplotlib, tensorboard, the conversion, lm-eval and wandb.
EXTRAS=${EXTRAS:-test,plot,tensorboard,convert,eval,wandb} scripts/setup_env.sh
# Slurm for tests/test_slurm.py: a real scheduler on this machine (those tests skip without it).
# Installed only as root on Debian-like machines; a failed install warns and carries on.
slurm_missing=0
for t in slurmctld slurmd munged sbatch srun scontrol; do
  PATH="$PATH:/usr/sbin:/sbin" command -v "$t" >/dev/null 2>&1 || slurm_missing=1
done
if [ "$slurm_missing" = 1 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "Installing Slurm (slurmctld slurmd slurm-client munge) for tests/test_slurm.py ..."
  slurm_pkgs="slurmctld slurmd slurm-client munge"
  policy_rc_added=0  # keep the packages' init scripts from starting system daemons
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \
      && policy_rc_added=1
  fi
  if { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $slurm_pkgs \
       || { apt-get update -qq \
            && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
               $slurm_pkgs; }; } > /tmp/slurm-install.log 2>&1; then
    echo "Slurm installed."
  else
    echo "WARNING: Slurm install failed (see /tmp/slurm-install.log); Slurm tests will skip."
  fi
  if [ "$policy_rc_added" = 1 ]; then rm -f /usr/sbin/policy-rc.d; fi
fi
# shellcheck disable=SC1091
. "${VENV:-.venv}/bin/activate"
# The suite starts a few hundred Python processes: let the first compile the package's
# bytecode for the others (an environment that sets PYTHONDONTWRITEBYTECODE would recompile
# megatron_boost in every one of them).
unset PYTHONDONTWRITEBYTECODE
python -m pytest -q -n "${TEST_WORKERS:-2}" ${tier[@]+"${tier[@]}"} "$@"
