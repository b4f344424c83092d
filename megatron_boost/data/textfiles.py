"""Input-file expansion shared by the text tools (tokenizer training, preprocessing).

Kept free of heavy imports so that ``tools/train_tokenizer.py`` starts in a blink.
"""

from __future__ import annotations

import glob
import os


def expand_inputs(patterns: list[str], prog: str) -> list[str]:
    """Expand files, directories (recursively, sorted) and globs into a sorted list of files.

    A pattern that names nothing ends the program with ``<prog>: error: ...``."""
    files: list[str] = []
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) or [pattern]
        for path in matches:
            if os.path.isdir(path):
                for root, _, names in sorted(os.walk(path)):
                    files.extend(
                        os.path.join(root, n) for n in sorted(names) if not n.startswith(".")
                    )
            elif os.path.isfile(path):
                files.append(path)
            else:
                raise SystemExit(f"{prog}: error: input '{path}' does not exist")
    return files
