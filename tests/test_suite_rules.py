"""Rules the test suite keeps about itself, checked on its source.

* Every ``subprocess.run`` / ``check_output`` / ``check_call`` / ``call`` in tests/ passes a
  ``timeout``: a hung child (a deadlocked collective, a rank waiting for a dead peer) must
  fail its test, not stall the suite. (``Popen`` is not checked here: its users wait with a
  deadline: ``communicate(timeout=...)``, ``wait(timeout=...)`` or a polling loop.)
* Every marker used in tests/ is registered in pyproject.toml (pytest runs with
  ``--strict-markers``, this names the offender without running the suite).
* Under pytest-xdist (scripts/test.sh runs two workers) a file's tests, and the files of a
  group of tests/conftest.py, run on one worker; every file the grouping names exists.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests import conftest

pytestmark = pytest.mark.fast  # the tiers: docs/testing.md

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
_BLOCKING = {"run", "check_output", "check_call", "call"}


def calls_without_timeout(source: str, name: str) -> list:
    """``file:line`` of each blocking ``subprocess.<fn>(...)`` call without ``timeout=``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in _BLOCKING
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "subprocess"
                and not any(k.arg == "timeout" for k in node.keywords)):
            found.append(f"{name}:{node.lineno}")
    return found


def test_every_subprocess_call_has_a_timeout():
    missing = [hit for path in sorted(TESTS.glob("*.py"))
               for hit in calls_without_timeout(path.read_text(encoding="utf-8"), path.name)]
    assert not missing, f"subprocess calls without a timeout: {missing}"


def test_the_timeout_check_finds_a_call_without_one():
    source = ("import subprocess\nsubprocess.run(['x'], timeout=5)\n"
              "subprocess.check_output(['y'])\n")
    assert calls_without_timeout(source, "t.py") == ["t.py:3"]


def test_every_marker_used_is_registered():
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    registered = set(re.findall(r'^\s*"(\w+):', pyproject, re.M))
    used = {m for path in TESTS.glob("*.py")
            for m in re.findall(r"pytest\.mark\.(\w+)", path.read_text(encoding="utf-8"))}
    builtin = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings"}
    assert {"fast", "compat"} <= registered
    assert used - builtin <= registered, used - builtin - registered


def test_every_file_the_worker_groups_name_exists():
    files = {path.stem for path in TESTS.glob("test_*.py")}
    named = set(conftest._WORKER_GROUPS)
    groups = {conftest.worker_group(f"tests/{stem}.py::t") for stem in files}
    assert named <= files, named - files
    assert set(conftest._LONGEST_FIRST) <= groups, set(conftest._LONGEST_FIRST) - groups


_RECORDING_TEST = """
import os, time
import pytest

@pytest.mark.parametrize("i", range(6))
def test_records_its_worker(i):
    time.sleep(0.05)
    with open(os.environ["WORKER_RECORD"], "a") as f:
        f.write(__name__ + " " + os.environ["PYTEST_XDIST_WORKER"] + "\\n")
"""


def test_two_workers_keep_each_file_and_each_group_on_one_worker(tmp_path):
    """Test files named like the suite's, with tests/conftest.py, under ``-n 2``: the two Slurm
    files share one worker (their clusters use fixed ports), the two conversion files share
    one (the trained checkpoints), every other file stays whole, and both workers ran tests."""
    shutil.copy(TESTS / "conftest.py", tmp_path / "conftest.py")
    stems = ["test_slurm", "test_slurm_training", "test_convert", "test_lm_eval",
             "test_alpha", "test_beta", "test_gamma"]
    for stem in stems:
        (tmp_path / f"{stem}.py").write_text(_RECORDING_TEST)
    record = tmp_path / "workers.txt"
    # the copied conftest imports the suite's hook modules (tests.leak_check): the repository
    # root on the path, as pytest puts it there for the real suite
    path = os.pathsep.join(filter(None, [str(TESTS.parent), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, WORKER_RECORD=str(record), PYTHONPATH=path)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p",
                           "no:cacheprovider", "-c", os.devnull, "--rootdir", str(tmp_path),
                           str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    workers = defaultdict(set)  # file or group -> the workers that ran its tests
    for line in record.read_text().splitlines():
        module, worker = line.split()
        workers[conftest.worker_group(f"{module}.py::t")].add(worker)
    assert set(workers) == {"slurm", "checkpoints", "test_alpha", "test_beta", "test_gamma"}
    assert all(len(ran) == 1 for ran in workers.values()), dict(workers)
    assert len(set().union(*workers.values())) == 2, dict(workers)
