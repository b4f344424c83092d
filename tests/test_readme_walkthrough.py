"""The README's own-corpus path, run as written: every ```bash block marked ``<!-- tested -->``
is taken from README.md, in order, and run from the repository root on a small synthetic corpus
(the page's settings block reads CORPUS, WORK, VOCAB and ITERS from the environment); once the
data is made, the rest of the page and its Slurm examples (with stand-ins) run side by side.
So the page cannot drift from the code: a renamed flag, a changed default or a broken step
fails here. corpus → tokenizer → preprocess → config (--check) → train at TP=2 (the
launcher, scripts/run_local.sh) → summary and curves → resume → export → sample → lm-eval →
import → train from the import. Also from the page: its launch command with a typo prints one
`error:` line and the exit status the troubleshooting section states; its set-up installs the
extras its commands need and ends with its success line; it mentions the tools, the launcher,
TensorBoard and W&B, and where to run from.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.doc_blocks import all_blocks, with_stand_ins
from tests.test_data import make_play

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "README.md"
_BLOCK = re.compile(r"<!-- tested -->\s*\n```bash\n(.*?)\n```", re.S)


def doc_commands() -> list[str]:
    return _BLOCK.findall(DOC.read_text())


def stand_in_commands() -> list[str]:
    """The blocks of README.md and docs/*.md marked ``<!-- tested with stand-ins -->``, in page
    order, the paths a user supplies mapped to stand-ins (tests/doc_blocks.py)."""
    return [with_stand_ins(b.body) for b in all_blocks() if b.kind == "stand-ins"]


#: A stand-in sbatch: checks that the job script it is given exists (as sbatch does), records
#: each call's arguments (one per line, then ----) and prints sbatch's answer.
FAKE_SBATCH = """#!/bin/sh
for a in "$@"; do
    case "$a" in -*) ;; *) [ -f "$a" ] || { echo "sbatch: error: Unable to open file $a" >&2; exit 1; }; break ;; esac
done
printf '%s\\n' "$@" ---- >> "$SBATCH_RECORD"
echo "Submitted batch job 42"
"""

# After the walk-through: its tokenizer and data stand in for the /shared files of the Slurm
# examples, and sbatch for the real one.
STAND_IN_SETUP = """
mkdir -p "$SHARED/data"
ln -s "$WORK/tokenizer.model" "$SHARED/data/tokenizer.model"
ln -s "$WORK/data/corpus.bin" "$SHARED/data/corpus.bin"
ln -s "$WORK/data/corpus.idx" "$SHARED/data/corpus.idx"
export PATH="$STAND_IN_BIN:$PATH"
"""


def test_the_page_has_its_steps():
    blocks = doc_commands()
    assert len(blocks) == 9, "a tested block lost its marker or its ```bash fence"
    joined = "\n".join(blocks)
    for step in ("train_tokenizer.py", "preprocess_data.py", "--check", "scripts/run_local.sh",
                 "summarize_run.py", "plot_runs.py", "export_hf.py", "lm_eval", "import_hf.py",
                 "imported/train.yaml"):
        assert step in joined, step


def launch_command() -> str:
    """The page's training command: the first tested line that starts the launcher."""
    return next(line for block in doc_commands() for line in block.splitlines()
                if line.startswith("scripts/run_local.sh "))


def test_the_launch_command_with_a_typo_is_one_error_line_and_the_stated_status(tmp_path):
    text = DOC.read_text()
    stated = re.search(r"\*\*`error: \.\.\.` and exit status (\d+)\*\*", text)
    assert stated, "the troubleshooting section no longer states the error's exit status"
    work = tmp_path / "work"
    work.mkdir()
    (work / "run.yaml").write_text((REPO / "configs" / "debug.yaml").read_text())
    env = dict(os.environ, WORK=str(work), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", "-c", launch_command() + " training.train_iter=5"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == int(stated.group(1)), (proc.returncode, proc.stderr[-3000:])
    assert proc.stdout == "", proc.stdout
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: unknown key 'train_iter' in section 'training'")


#: The extra each command of the page needs (pyproject.toml's optional dependencies).
EXTRA_OF = {"lm_eval ": "eval", "tools/export_hf.py": "convert", "tools/generate.py": "convert",
            "tools/import_hf.py": "convert", "tools/plot_runs.py": "plot"}


def test_the_set_up_installs_what_the_commands_use():
    setup = re.search(r"^EXTRAS=(\S+) scripts/setup_env\.sh", DOC.read_text(), re.M)
    assert setup, "the page's set-up command lost its EXTRAS"
    installed = set(setup.group(1).split(","))
    joined = "\n".join(doc_commands())
    needed = {extra for command, extra in EXTRA_OF.items() if command in joined}
    assert needed and needed <= installed, (needed, installed)
    pyproject = (REPO / "pyproject.toml").read_text()
    for extra in installed | {"wandb"}:
        assert re.search(rf"^{extra} = \[", pyproject, re.M), extra


def test_the_set_up_ends_with_its_success_line(tmp_path):
    """An environment that is up to date: setup_env.sh installs nothing and says so, with
    what it holds (a venv of links to this environment's interpreter and packages)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    real = Path(sys.prefix)
    (venv / "bin" / "python").symlink_to(Path(sys.executable).resolve())
    (venv / "lib").symlink_to(real / "lib")
    (venv / "pyvenv.cfg").write_text((real / "pyvenv.cfg").read_text())
    (venv / "bin" / "activate").write_text(f"export VIRTUAL_ENV={venv}\n"
                                           f"export PATH={real / 'bin'}:$PATH\n")
    digest = subprocess.run("cat pyproject.toml requirements.txt | sha1sum | cut -c1-40",
                            shell=True, cwd=REPO, capture_output=True, text=True,
                            timeout=60).stdout.strip()
    (venv / ".megatron-boost-installed").write_text(f"{digest}-any-any\nconvert,plot\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MCORE", "TORCH")}
    proc = subprocess.run([str(REPO / "scripts" / "setup_env.sh"), "--cpu"], cwd=REPO,
                          env=dict(env, VENV=str(venv), EXTRAS="plot"), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import megatron.core
    import torch

    assert proc.stdout.splitlines()[-1] == (
        f"setup_env.sh: up to date, nothing installed: {venv} (Python "
        f"{sys.version.split()[0]}, torch {torch.__version__}, megatron-core "
        f"{megatron.core.__version__}, megatron-boost 0.1.0; extras: convert,plot); enter it "
        f"with: . {venv}/bin/activate"), proc.stdout


def test_the_page_mentions_what_exists():
    text = " ".join(DOC.read_text().split())
    for mention in ("tools/summarize_run.py", "tools/plot_runs.py", "scripts/run_local.sh",
                    "megatron-boost-train", "logging.tensorboard: true", "<run_dir>/tensorboard",
                    "logging.wandb:", "Run them from the repository root",
                    "relative to the directory a command runs in"):
        assert mention in text, mention
    for path in ("tools/summarize_run.py", "tools/plot_runs.py", "scripts/run_local.sh"):
        assert (REPO / path).is_file(), path
    assert 'megatron-boost-train = "megatron_boost.cli.launch:main"' in \
        (REPO / "pyproject.toml").read_text()


def _scripts() -> tuple[str, list[str]]:
    """The walk-through as bash scripts: the page's blocks up to its data (settings, tokenizer,
    preprocessing), then two that need only that data and run side by side, each after the
    settings block: the page's remaining blocks in order, and the Slurm examples with their
    stand-ins."""
    blocks = doc_commands()
    data = next(i for i, b in enumerate(blocks) if "preprocess_data.py" in b) + 1
    strict = "set -euo pipefail"
    return ("\n".join([strict, *blocks[:data]]),
            ["\n".join([strict, blocks[0], *blocks[data:]]),
             "\n".join([strict, blocks[0], STAND_IN_SETUP, *stand_in_commands()])])


def _run_walk_through(env) -> str:
    """Run :func:`_scripts` from the repository root; their output (each must exit 0)."""
    data, side_by_side = _scripts()
    proc = subprocess.run(["bash", "-c", data], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    outs = [proc.stdout + proc.stderr]
    procs = [subprocess.Popen(["bash", "-c", script], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True)  # its group is killed on a failure
             for script in side_by_side]
    try:
        for p in procs:
            outs.append(p.communicate(timeout=2400)[0])
            assert p.returncode == 0, outs[-1][-5000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate(timeout=60)
    return "".join(outs)


def test_the_own_corpus_walk_through_runs_as_written(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("lm_eval")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rng = random.Random(7)
    for i in range(40):
        (corpus / f"doc_{i:02d}.txt").write_text(make_play(rng, i, 30), encoding="utf-8")
    bin_dir = str(Path(sys.executable).parent)  # torchrun, lm_eval of this environment
    stand_in_bin = tmp_path / "stand-in-bin"
    stand_in_bin.mkdir()
    (stand_in_bin / "sbatch").write_text(FAKE_SBATCH)
    (stand_in_bin / "sbatch").chmod(0o755)
    record = tmp_path / "sbatch-calls"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                        "NPROC_PER_NODE", "MBOOST_DEVICE", "SRUN_ARGS", "TORCHRUN",
                        "CKPT_WRITE_MIB_S", "PYTHON_ENV")}
    env.update(CORPUS=str(corpus), WORK=str(tmp_path / "work"), VOCAB="400", ITERS="6",
               PATH=f"{bin_dir}:{env['PATH']}", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               SHARED=str(tmp_path / "shared"), STAND_IN_BIN=str(stand_in_bin),
               SBATCH_RECORD=str(record))
    out = _run_walk_through(env)
    work = tmp_path / "work"
    assert "check passed: 2 processes = tp 2 x pp 1 x dp 1 (mode boost) | " in out, out[-3000:]
    assert re.search(r"^summary: 6 iterations, .* \| training time ", out, re.M), out[-3000:]
    assert (work / "curves.png").is_file()
    assert f"resumed from {work}/run/checkpoints" in out and "at iteration 6 (" in out, out[-3000:]
    records = [json.loads(line) for line in (work / "run" / "metrics.jsonl").open()]
    assert max(r["iteration"] for r in records) == 9  # ITERS + ITERS / 2
    assert (work / "hf" / "config.json").is_file()
    assert re.search(r"\|my_choice\s*\|", out), out[-3000:]  # lm-eval's result table
    assert "initialised from the weights of" in out and "checkpoint.init_from" in out
    assert (work / "imported-run" / "checkpoints").is_dir()
    # the Slurm examples (the README's and docs/paper-table.md's), with the stand-ins
    assert "check passed: 16 processes = tp 4 x pp 1 x dp 4 (mode boost) | " in out, out[-3000:]
    assert "submit.sh: dry run, nothing submitted" in out and "--nnodes 2 --nproc-per-node 8" \
        in out, out[-3000:]
    calls = [c.strip().splitlines() for c in record.read_text().split("----")[:-1]]
    submitted = [c for c in calls if "scripts/slurm/pretrain.sbatch" in c]
    assert len(submitted) == 3, calls  # the dry run submitted nothing
    for call in submitted:
        assert call[0].startswith("--signal=B:USR1@") and call[-4:] == [
            "configs/cola-7b.yaml", f"data.data_path=[{tmp_path}/shared/data/corpus]",
            f"data.tokenizer_model={tmp_path}/shared/data/tokenizer.model",
            f"logging.run_dir={tmp_path}/shared/runs/cola-7b"], call
    assert any("scripts/slurm/paper_table.sh" in c for c in calls), calls
