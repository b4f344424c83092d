"""Rules the test suite keeps about itself, checked on its source.

* Every ``subprocess.run`` / ``check_output`` / ``check_call`` / ``call`` in tests/ passes a
  ``timeout``: a hung child (a deadlocked collective, a rank waiting for a dead peer) must
  fail its test, not stall the suite. (``Popen`` is not checked here: its users wait with a
  deadline: ``communicate(timeout=...)``, ``wait(timeout=...)`` or a polling loop.)
* Every marker used in tests/ is registered in pyproject.toml (pytest runs with
  ``--strict-markers``, this names the offender without running the suite).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

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
