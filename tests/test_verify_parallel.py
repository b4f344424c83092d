"""tools/verify_parallel.py: the user-facing layout verifier, end to end."""

import subprocess
import sys
from pathlib import Path

import pytest

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


def test_verifier_fails_a_corrupted_layout():
    r = _run("--config", "configs/debug.yaml", "--tp", "2", "--mode", "naive", "--tiny",
             "--negative-control")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.strip().splitlines()[-1].endswith(" FAIL")


def test_verifier_reports_bad_layout_clearly():
    r = _run("--config", "configs/debug.yaml", "--tp", "3")
    assert r.returncode == 2
    assert "must be divisible by tensor_model_parallel_size (3)" in r.stderr
