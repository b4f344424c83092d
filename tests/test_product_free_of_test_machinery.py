"""The product reads no test variable: fault injection lives in the harness
(``megatron_boost/testing/faults.py``), installed from outside through the trainer's callbacks
(``megatron_boost/train/callbacks.py``) by ``tests/fault_entry.py``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: An environment variable's name with TEST in it (MEGATRON_BOOST_TEST_NAN_AT, PYTEST_...).
TEST_VARIABLE = re.compile(r"\b[A-Z][A-Z0-9_]*TEST[A-Z0-9_]*\b")


def product_files() -> list:
    """What a user runs: the package without its test harness (``testing/``), the entry
    script, the tools and the launch scripts."""
    package = [p for p in (ROOT / "megatron_boost").rglob("*.py")
               if "testing" not in p.relative_to(ROOT / "megatron_boost").parts]
    scripts = [ROOT / "scripts" / "run_local.sh", ROOT / "scripts" / "launch_env.sh",
               *(ROOT / "scripts" / "slurm").iterdir()]
    return sorted([*package, ROOT / "pretrain_lowrank.py", *(ROOT / "tools").glob("*.py"),
                   *(p for p in scripts if p.is_file())])


def variables_named_test_in(files) -> list:
    """'path:line: NAME' for every test variable named in ``files``."""
    found = []
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            found += [f"{path.relative_to(ROOT)}:{number}: {name}"
                      for name in TEST_VARIABLE.findall(line)]
    return found


@pytest.mark.fast
def test_the_product_reads_no_test_variable():
    files = product_files()
    assert ROOT / "megatron_boost" / "train" / "trainer.py" in files  # the scan sees the trainer
    assert variables_named_test_in(files) == []


@pytest.mark.fast
def test_the_harness_still_names_its_fault_variables():
    """The scan would find them: the harness names them (a scan that finds nothing anywhere
    proves nothing)."""
    harness = ROOT / "megatron_boost" / "testing" / "faults.py"
    assert "MEGATRON_BOOST_TEST_NAN_AT" in " ".join(variables_named_test_in([harness]))
