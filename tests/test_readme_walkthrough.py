"""The README's own-corpus path, run as written: every ```bash block marked ``<!-- tested -->``
is taken from README.md, in order, and run as one script from the repository root on a small synthetic
corpus (the page's settings block reads CORPUS, WORK, VOCAB and ITERS from the environment).
So the page cannot drift from the code: a renamed flag, a changed default or a broken step
fails here. corpus → tokenizer → preprocess → config (--check) → train at TP=2 → resume →
export → sample → lm-eval → import → train from the import.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_data import make_play

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "README.md"
_BLOCK = re.compile(r"<!-- tested -->\s*\n```bash\n(.*?)\n```", re.S)


def doc_commands() -> list[str]:
    return _BLOCK.findall(DOC.read_text())


def test_the_page_has_its_steps():
    blocks = doc_commands()
    assert len(blocks) == 8, "a tested block lost its marker or its ```bash fence"
    joined = "\n".join(blocks)
    for step in ("train_tokenizer.py", "preprocess_data.py", "--check", "torchrun",
                 "export_hf.py", "lm_eval", "import_hf.py", "imported/train.yaml"):
        assert step in joined, step


def test_the_own_corpus_walk_through_runs_as_written(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("lm_eval")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(7)
    for i in range(40):
        (corpus / f"doc_{i:02d}.txt").write_text(make_play(rng, i, 30), encoding="utf-8")
    bin_dir = str(Path(sys.executable).parent)  # torchrun, lm_eval of this environment
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(CORPUS=str(corpus), WORK=str(tmp_path / "work"), VOCAB="400", ITERS="6",
               PATH=f"{bin_dir}:{env['PATH']}", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    script = "set -euo pipefail\n" + "\n".join(doc_commands())
    proc = subprocess.run(["bash", "-c", script], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1800)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    work = tmp_path / "work"
    assert f"resumed from {work}/run/checkpoints" in out and "at iteration 6 (" in out, out[-3000:]
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").open()]
    assert max(r["iteration"] for r in records) == 9  # ITERS + ITERS / 2
    assert (work / "hf" / "config.json").is_file()
    assert re.search(r"\|my_choice\s*\|", out), out[-3000:]  # lm-eval's result table
    assert "initialised from the weights of" in out and "checkpoint.init_from" in out
    assert (work / "imported-run" / "checkpoints").is_dir()
