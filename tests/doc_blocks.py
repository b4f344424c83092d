"""The shell blocks of README.md and docs/*.md and how each is exercised, from the HTML comment
on the line before its fence:

    <!-- tested -->                 run in order, as printed, by tests/test_readme_walkthrough.py
                                    (README.md's own-corpus walk-through)
    <!-- tested with stand-ins -->  run as printed by the same test after those, in page order,
                                    with a recording `sbatch` on PATH and the paths a user
                                    supplies (STAND_INS) mapped to the walk-through's files
    <!-- not run: WHY -->           cannot run here (GPUs, minutes of training, the suite
    <!-- not run: WHY | check: COMMAND -->   itself); COMMAND, when given, is what runs instead
                                    (tests/test_doc_commands.py: the block's configuration and
                                    layout through `pretrain_lowrank.py --check` or
                                    `submit.sh --dry-run`)

A shell block (```bash, ```sh, ```shell, ```console or a bare ```) without one of these fails
tests/test_doc_commands.py, so a new example is either run or says why it is not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[1]
SHELL_LANGUAGES = ("bash", "sh", "shell", "console", "zsh", "")
_FENCE = re.compile(r"^```(\S*)\s*$")
_MARKER = re.compile(r"^<!-- (tested|tested with stand-ins|not run: (.+?)) -->$")

#: The paths a user supplies in the stand-in blocks, and what the walk-through maps them to
#: ($SHARED: a directory it fills with the walk-through's tokenizer and data).
STAND_INS = {"/shared/": "$SHARED/"}


@dataclass
class Block:
    path: Path
    line: int          # 1-based line of the opening fence
    language: str
    kind: Optional[str]  # 'tested', 'stand-ins', 'not run' or None (unclassified)
    reason: str        # the 'not run' reason
    check: str         # the 'not run' block's check command ('' when none)
    body: str

    @property
    def where(self) -> str:
        return f"{self.path.name}:{self.line}"


def doc_pages(root: Path = REPO) -> List[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _classify(marker_line: str):
    m = _MARKER.match(marker_line.strip())
    if not m:
        return None, "", ""
    if m.group(1) == "tested":
        return "tested", "", ""
    if m.group(1) == "tested with stand-ins":
        return "stand-ins", "", ""
    reason, _, check = m.group(2).partition(" | check: ")
    return "not run", reason.strip(), check.strip()


def shell_blocks(path: Path) -> List[Block]:
    """Every shell block of one page, in order, with its classification."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        fence = _FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        if fence.group(1) in SHELL_LANGUAGES:
            kind, reason, check = _classify(lines[i - 1] if i else "")
            blocks.append(Block(path, i + 1, fence.group(1), kind, reason, check,
                                "\n".join(lines[i + 1:end])))
        i = end + 1
    return blocks


def all_blocks(root: Path = REPO) -> List[Block]:
    return [b for page in doc_pages(root) for b in shell_blocks(page)]


def with_stand_ins(body: str) -> str:
    for user_path, stand_in in STAND_INS.items():
        body = body.replace(user_path, stand_in)
    return body
