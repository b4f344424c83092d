"""The one-line standard holds for every entry point that exists, and for every one added: the
entry points are discovered from the file system (tools/*.py and *.sh, scripts/*.py and *.sh,
scripts/slurm/*, pretrain_lowrank.py) and pyproject.toml's console scripts, and each must have

* a bad-input case in tests/test_bad_input.py's table (one ``error:`` line, exit status 2, no
  traceback, nothing written: that file runs and checks them), found by the file it runs (a
  console script by its name, or by a case of the file that runs the same ``main``), and
* a ``--help`` that exits 0 with a usage text on stdout and no traceback, run here: the Python
  tools in this process through ``main(["--help"])`` (tests/test_bad_input.py's machinery), the
  shell scripts as processes (bash only; those that hand ``--help`` to a Python tool start one).

A file that is sourced rather than run says so in its first comment line (``# Sourced``)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.test_bad_input import (CASES, MAINS, Ctx, _call_main,
                                  _environment_of_a_fresh_launch)
from tests.test_training import ROOT, _env

HELP_TIMEOUT = 120


def _sourced(path: Path) -> bool:
    return any(line.startswith("# Sourced") for line in path.read_text().splitlines()[:2])


def script_entry_points() -> list:
    """Every file a user runs, relative to the repository root."""
    patterns = ("tools/*.py", "tools/*.sh", "scripts/*.py", "scripts/*.sh", "scripts/slurm/*",
                "pretrain_lowrank.py")
    found = {p for pattern in patterns for p in ROOT.glob(pattern) if p.is_file()}
    return sorted(str(p.relative_to(ROOT)) for p in found if not _sourced(p))


def console_scripts() -> dict:
    """pyproject.toml's console scripts: name -> module whose ``main`` it runs."""
    with open(ROOT / "pyproject.toml", "rb") as fh:
        scripts = tomllib.load(fh)["project"]["scripts"]
    return {name: target.split(":")[0] for name, target in scripts.items()}


def _case_argvs() -> list:
    ctx = Ctx(Path("case"), Path("shared"))
    return [[str(a) for a in c.argv(ctx)] for c in CASES]


def _runs(argv: list, entry: str) -> bool:
    return any(a == entry or a.endswith("/" + entry) for a in argv)


def test_entry_points_are_found():
    scripts = script_entry_points()
    assert "pretrain_lowrank.py" in scripts and "scripts/setup_env.sh" in scripts
    assert "scripts/launch_env.sh" not in scripts  # sourced by the launchers
    assert len(scripts) >= 30 and len(console_scripts()) >= 15


@pytest.mark.parametrize("entry", script_entry_points())
def test_every_script_has_a_bad_input_case(entry):
    assert any(_runs(argv, entry) for argv in _case_argvs()), (
        f"{entry} has no case in tests/test_bad_input.py's table: add one bad input (one "
        f"error: line, exit status 2)")


@pytest.mark.parametrize("name", sorted(console_scripts()))
def test_every_console_script_has_a_bad_input_case(name):
    module = console_scripts()[name]
    files = [f for f, m in MAINS.items() if m == module]
    assert any(_runs(argv, name) or any(_runs(argv, f) for f in files)
               for argv in _case_argvs()), (
        f"console script {name} ({module}) has no case in tests/test_bad_input.py's table")


def _help_in_process(entry: str) -> subprocess.CompletedProcess:
    with _environment_of_a_fresh_launch():
        return _call_main([sys.executable, entry, "--help"])


def _help_process(entry: str) -> subprocess.CompletedProcess:
    cmd = ["bash", entry] if not entry.endswith(".py") else [sys.executable, entry]
    env = dict(_env(), PYTHON=sys.executable)  # tools/gpu_check.sh's interpreter
    return subprocess.run([*cmd, "--help"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=HELP_TIMEOUT)


def _help_entries() -> list:
    return script_entry_points() + sorted(console_scripts())


@pytest.mark.parametrize("entry", _help_entries())
def test_every_entry_point_answers_help(entry, monkeypatch):
    if entry in console_scripts():  # its main, in this process
        monkeypatch.setitem(MAINS, entry, console_scripts()[entry])
    in_process = Path(entry).name in MAINS
    proc = _help_in_process(entry) if in_process else _help_process(entry)
    text = proc.stdout + proc.stderr
    shown = f"exit {proc.returncode}\n{text[-2000:]}"
    assert "Traceback" not in text, shown
    assert proc.returncode == 0, shown
    assert proc.stdout.strip() and ("usage" in proc.stdout.lower() or len(
        proc.stdout.splitlines()) >= 3), shown
