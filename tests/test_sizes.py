"""The sizes a reader can hold: no module of the package over 600 lines; no function of the
package, its tools, its scripts or the trainer's entry over 50 (from its ``def`` to its last
line, docstring included); a README of at most 300 lines (the detail lives in docs/, which it
links); docs/design.md's sections numbered without a gap. Read statically with ``ast``."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Iterable, List

import pytest

pytestmark = pytest.mark.fast  # the tiers: docs/testing.md

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES, MAX_FUNCTION_LINES, MAX_README_LINES = 600, 50, 300


def _python_files() -> List[Path]:
    return [*sorted((ROOT / "megatron_boost").rglob("*.py")), *sorted((ROOT / "tools").rglob("*.py")),
            *sorted((ROOT / "scripts").rglob("*.py")), ROOT / "pretrain_lowrank.py"]


def long_modules(paths: Iterable[Path], root: Path = ROOT) -> List[str]:
    """'path (n lines)' of each module over the file limit."""
    return [f"{p.relative_to(root).as_posix()} ({n} lines)" for p in paths
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]


def long_functions(paths: Iterable[Path], root: Path = ROOT) -> List[str]:
    """'path:function (n lines)' of each function over the function limit."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(root).as_posix()}:{node.name} ({lines} lines)")
    return found


def section_numbers(markdown: str) -> List[int]:
    return [int(n) for n in re.findall(r"^## (\d+)\. ", markdown, flags=re.M)]


def test_no_module_over_600_lines():
    assert long_modules(sorted((ROOT / "megatron_boost").rglob("*.py"))) == []


def test_no_function_over_50_lines():
    assert long_functions(_python_files()) == []


def test_the_readme_is_at_most_300_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) <= MAX_README_LINES


def test_design_sections_are_numbered_without_a_gap():
    numbers = section_numbers((ROOT / "docs" / "design.md").read_text())
    assert numbers == list(range(1, len(numbers) + 1))


def test_the_checks_see_a_long_function_a_long_module_and_a_gap(tmp_path):
    """Negative controls: a 51-line function, a 601-line module and a missing section."""
    body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "long_function.py").write_text(f"def f():\n{body}")
    (tmp_path / "long_module.py").write_text("x = 1\n" * (MAX_FILE_LINES + 1))
    paths = sorted(tmp_path.glob("*.py"))
    assert long_functions(paths, tmp_path) == ["long_function.py:f (51 lines)"]
    assert long_modules(paths, tmp_path) == [f"long_module.py ({MAX_FILE_LINES + 1} lines)"]
    assert section_numbers("## 1. a\n## 3. c\n") == [1, 3]
