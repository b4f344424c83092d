"""Every shell block of README.md and docs/*.md is run by a test or says why it cannot run here
(tests/doc_blocks.py has the markers). The blocks themselves run in
tests/test_readme_walkthrough.py; here: that none is unclassified, that a new unclassified one
fails, and that a block that cannot run has what runs in its place (its configuration and
layout through the project's check) pass.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_blocks import REPO, STAND_INS, all_blocks, shell_blocks

pytestmark = pytest.mark.fast


def test_every_shell_block_is_run_or_says_why_not():
    blocks = all_blocks()
    unclassified = [b.where for b in blocks if b.kind is None]
    assert unclassified == [], ("a shell block without <!-- tested -->, <!-- tested with "
                                "stand-ins --> or <!-- not run: WHY -->", unclassified)
    for b in blocks:
        if b.kind == "not run":
            assert len(b.reason.split()) >= 3, (b.where, "say why it cannot run here")
    # the walk-through runs README.md's tested blocks only, in its order
    assert {b.path.name for b in blocks if b.kind == "tested"} == {"README.md"}
    stand_ins = [b for b in blocks if b.kind == "stand-ins"]
    assert stand_ins and all("sbatch" in b.body or any(p in b.body for p in STAND_INS)
                             for b in stand_ins), [b.where for b in stand_ins]


def test_a_new_unclassified_block_is_found(tmp_path):
    """Negative control: a page with a bare example and a marker-less bash block."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("x\n\n<!-- tested -->\n```bash\ntrue\n```\n")
    (tmp_path / "docs" / "new.md").write_text(
        "Run\n\n```bash\npython tools/new_tool.py\n```\n\n```\nls\n```\n\n```text\nout\n```\n"
        "<!-- not run: needs GPUs | check: python pretrain_lowrank.py --check -->\n"
        "```sh\nrun_on_gpu\n```\n")
    blocks = all_blocks(tmp_path)
    assert [(b.where, b.kind) for b in blocks] == [
        ("README.md:4", "tested"), ("new.md:3", None), ("new.md:7", None),
        ("new.md:15", "not run")]
    gpu = shell_blocks(tmp_path / "docs" / "new.md")[-1]
    assert (gpu.reason, gpu.check) == ("needs GPUs", "python pretrain_lowrank.py --check")


@pytest.mark.parametrize("block", [b for b in all_blocks() if b.check],
                         ids=lambda b: b.where)
def test_a_block_that_cannot_run_passes_its_check(block):
    """A GPU block's configuration and layout pass `pretrain_lowrank.py --check` (or
    `submit.sh --dry-run`), run as the marker names it, from the repository root."""
    words = shlex.split(block.check)
    assert words[:2] == ["python", "pretrain_lowrank.py"] and "--check" in words \
        or words[0] == "scripts/slurm/submit.sh" and "--dry-run" in words, block.check
    if words[0] == "python":
        words[0] = sys.executable
    proc = subprocess.run(words, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, (block.where, proc.stdout, proc.stderr)
    assert "check passed: " in proc.stdout
