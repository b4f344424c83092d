"""Reading a YAML run file into a mapping, with one clear error per way it can be bad.

``yaml.safe_load`` on a bad file raises a multi-line ``yaml.YAMLError`` (or ``OSError``,
``UnicodeDecodeError``); a file that is empty or holds a list loads without complaint and fails
later, far from the cause. :func:`read_yaml_mapping` turns each case into a ``ValueError`` that
names the file and the rule it breaks, so the entry points print one ``error:`` line.
:func:`key_lines` gives the line of every key, so a later error about a key (unknown, wrong
type) can name ``file:line``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

import yaml

__all__ = ["read_yaml_mapping", "key_lines"]


def _read_text(path: Path) -> str:
    """The file's text, or ``ValueError`` when it is missing, a directory or unreadable."""
    if not path.exists():
        raise ValueError(f"config file '{path}' does not exist")
    if path.is_dir():
        raise ValueError(f"config file '{path}' is a directory; give a YAML file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"config file '{path}' is not UTF-8 text (byte {err.start}); "
                         f"give a YAML file") from None
    except OSError as err:
        raise ValueError(f"config file '{path}' cannot be read ({err.strerror})") from None


def _parse(text: str, path: Path) -> Any:
    """``yaml.safe_load`` with a syntax error reported as file:line:column and the problem."""
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ValueError(f"config file '{where}' is not valid YAML: {err.problem}") from None
    except yaml.YAMLError as err:
        raise ValueError(f"config file '{path}' is not valid YAML: {err}") from None


def read_yaml_mapping(path: str) -> Dict[str, Any]:
    """The top-level mapping of a YAML run file (section name -> section mapping).

    Raises ``ValueError`` naming the file when it is missing, unreadable, not YAML, empty, or
    not a mapping of section names."""
    p = Path(path)
    raw = _parse(_read_text(p), p)
    if raw is None:
        raise ValueError(f"config file '{path}' is empty; it must hold a mapping of sections "
                         f"(model:, parallel:, training:, ...)")
    if not isinstance(raw, dict):
        raise ValueError(f"config file '{path}' must hold a mapping of sections (model:, "
                         f"parallel:, ...), got a {type(raw).__name__}")
    bad = [k for k in raw if not isinstance(k, str)]
    if bad:
        raise ValueError(f"config file '{path}': section name {bad[0]!r} must be a string")
    return raw


def key_lines(path: str) -> Dict[str, int]:
    """The 1-based line of every mapping key of a YAML file that :func:`read_yaml_mapping`
    accepted, by dotted path (``model.hidden_size`` -> 3). Keys that are not strings are left
    out."""
    root = yaml.compose(Path(path).read_text(encoding="utf-8"))
    lines: Dict[str, int] = {}

    def walk(node, prefix: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for key, value in node.value:
            if isinstance(key, yaml.ScalarNode):
                dotted = f"{prefix}{key.value}"
                lines[dotted] = key.start_mark.line + 1
                walk(value, dotted + ".")

    walk(root, "")
    return lines
