"""TPMode past config parsing: no module of the package compares a mode with its name or keys
a table by the names (issue 38's "one vocabulary"). The entry points turn their --mode(s)
strings into TPMode as they parse them (cli/arg_types.py) and build and read the labels that
are not modes (``full+sp``) in cli/mode_labels.py only."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Tuple

import pytest

pytestmark = pytest.mark.fast  # the tiers: docs/testing.md

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_boost"
MODE_NAMES = {"full", "naive", "boost"}
#: runtime/ sits below config/ (tests/test_import_graph.py) and cannot import TPMode.
NOT_CHECKED = ("runtime",)


def _names(node: ast.AST) -> set:
    """The string constants of ``node``: itself, or the elements of a tuple, list or set."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}


def _mode_names_used(tree: ast.AST, source: str) -> Iterator[Tuple[int, str]]:
    """(line, text) of each comparison of something called a mode with a mode's name, and of
    each dictionary keyed by the mode names."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            text = ast.get_source_segment(source, node) or ""
            if "mode" in text and any(_names(side) & MODE_NAMES for side in sides):
                yield node.lineno, text
        elif isinstance(node, ast.Dict):
            keys = set().union(*(_names(k) for k in node.keys if k is not None))
            if len(keys & MODE_NAMES) >= 2:
                yield node.lineno, ast.get_source_segment(source, node) or ""


def _checked_modules() -> Iterator[Path]:
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] not in NOT_CHECKED:
            yield path


def test_no_mode_is_told_apart_by_its_name():
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
             for path in _checked_modules()
             for line, text in _mode_names_used(ast.parse(path.read_text()), path.read_text())]
    assert not found, "compare with TPMode members, not their names:\n" + "\n".join(found)


def test_the_check_sees_a_name_comparison_and_a_name_keyed_table():
    """The check's own negative control: the two forms it exists to refuse."""
    source = 'ok = mode == "boost"\nt = {"full": 1, "naive": 2}\nr = recompute == "full"\n'
    assert [line for line, _ in _mode_names_used(ast.parse(source), source)] == [1, 2]
