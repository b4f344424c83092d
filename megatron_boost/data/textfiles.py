"""Input-file expansion shared by the text tools (tokenizer training, preprocessing).

Kept free of heavy imports so that ``tools/train_tokenizer.py`` starts in a blink. Every file
is checked to be text (its first bytes hold no NUL byte and decode as UTF-8): the tools read
with ``errors="replace"``, so a binary file would otherwise become a document of replacement
characters without a word.
"""

from __future__ import annotations

import glob
import os

#: bytes read from the start of each input to tell text from binary.
_SNIFF_BYTES = 8192


def _check_text(path: str, prog: str) -> None:
    """End the program with ``<prog>: error: ...`` when ``path`` starts like a binary file."""
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    nul = head.find(b"\0")
    if nul >= 0:
        raise SystemExit(f"{prog}: error: input '{path}' is a binary file (NUL byte at offset "
                         f"{nul}); the text tools read UTF-8 text and .jsonl files: remove it "
                         f"or narrow --input")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(head) - 3:  # not just a character cut at the end of the sample
            raise SystemExit(f"{prog}: error: input '{path}' is not UTF-8 text (byte "
                             f"{err.start}); convert it to UTF-8 or remove it from --input") \
                from None


def expand_inputs(patterns: list[str], prog: str) -> list[str]:
    """Expand files, directories (recursively, sorted) and globs into a sorted list of files.

    A pattern that names nothing, or a file that is not text, ends the program with
    ``<prog>: error: ...``."""
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
    for path in files:
        _check_text(path, prog)
    return files
