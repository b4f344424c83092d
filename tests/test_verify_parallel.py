"""tools/verify_parallel.py: the user-facing layout verifier, end to end (one run as the
command users run, the others through its main(argv))."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_boost.cli.verify_parallel import main

pytestmark = pytest.mark.compat  # the tiers: docs/testing.md

ROOT = Path(__file__).resolve().parents[1]


def _run(*args):
    return subprocess.run([sys.executable, "tools/verify_parallel.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_verifier_passes_a_good_layout():
    r = _run("--config", "configs/cola-7b.yaml", "--tp", "2", "--tiny")
    last = r.stdout.strip().splitlines()[-1]
    assert r.returncode == 0, r.stdout + r.stderr
    assert last.startswith("max_rel_loss_diff=") and last.endswith(" OK")


# The two below call the verifier's main(argv) in this process: the same code as the command
# (tools/verify_parallel.py only exits with main()'s status, which the run above checks), and
# the negative control still spawns its reference and layout processes; only the extra
# interpreter and its imports are saved.


def test_verifier_fails_a_corrupted_layout(capsys):
    status = main(["--config", str(ROOT / "configs/debug.yaml"), "--tp", "2", "--mode",
                   "naive", "--tiny", "--negative-control"])
    out = capsys.readouterr()
    assert status == 1, out.out + out.err
    assert out.out.strip().splitlines()[-1].endswith(" FAIL")


def test_verifier_reports_bad_layout_clearly(capsys):
    status = main(["--config", str(ROOT / "configs/debug.yaml"), "--tp", "3"])
    assert status == 2
    assert "must be divisible by tensor_model_parallel_size (3)" in capsys.readouterr().err
