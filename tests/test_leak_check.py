"""The end-of-session process check (tests/leak_check.py): a session that leaves a process tree
running fails, naming it, and the tree is gone afterwards; so does one that leaves an orphan (a
process whose parent has ended, no longer a descendant of the session); a clean session
passes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.fast  # the tiers: docs/testing.md

ROOT = Path(__file__).resolve().parents[1]

_LEAKS = '''
import subprocess


def test_leaves_a_process_tree():
    # a shell whose two children sleep: a tree of three, none waited for
    subprocess.Popen(["bash", "-c", "sleep 300 & sleep 300"])
'''

_ORPHAN = '''
import subprocess


def test_leaves_an_orphan():
    # the shell starts a sleep in a subshell and ends: the sleep is adopted by init
    subprocess.run(["bash", "-c", "(sleep 300 &)"], check=True)
'''

_CLEAN = '''
import subprocess


def test_waits_for_its_process():
    subprocess.run(["sleep", "0"], check=True)
'''


def _session(tmp_path: Path, source: str) -> subprocess.CompletedProcess:
    """A pytest session over one test file, with the check loaded as a plugin."""
    test = tmp_path / "test_subject.py"
    test.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LEAK_CHECK_GRACE_S": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.leak_check",
                           "-p", "no:cacheprovider", str(test)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_leaked_process_tree_fails_the_session(tmp_path):
    proc = _session(tmp_path, _LEAKS)
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, out
    pids = [int(p) for p in re.findall(r"error: process (\d+) .*outlived the test session", out)]
    assert len(pids) == 3, out  # the shell and both sleeps
    alive = [p for p in pids if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], out


def test_an_orphaned_process_fails_the_session(tmp_path):
    """A process whose parent ended before the session did still counts: it carries the
    session's token (without the token, the check sees descendants only and passes this)."""
    proc = _session(tmp_path, _ORPHAN)
    out = proc.stdout + proc.stderr
    assert proc.returncode == pytest.ExitCode.TESTS_FAILED, out
    named = re.findall(r"error: process (\d+) \((.*)\) outlived the test session", out)
    assert [cmd for _, cmd in named] == ["sleep 300"], out
    pid = int(named[0][0])
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_clean_session_passes(tmp_path):
    proc = _session(tmp_path, _CLEAN)
    assert proc.returncode == 0, proc.stdout + proc.stderr
