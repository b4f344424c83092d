"""Quiet output: a tool's log holds its own lines only. megatron's known import notices are
filtered once (compat.py's ``quiet_known_warnings``, run by ``megatron_boost/cli``) for every
entry point, no progress bar writes carriage returns into a log that is not a terminal, and the
launcher sets OMP_NUM_THREADS itself, so torchrun prints no banner about it.

Subprocesses (each with a timeout): pytest's own warning filters (pyproject.toml) would hide
the notices in this process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 300


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTHONWARNINGS")}
    return dict(env, PYTHONPATH=str(ROOT), **extra)


def test_preprocess_data_prints_its_line_and_nothing_else(tmp_path):
    """tools/preprocess_data.py loads megatron's tokenizer (which imports the modules that
    print "Transformer Engine and Apex are not installed") and shows a progress bar on a
    terminal: into a log, only its one result line."""
    from tests.convert_fixtures import train_tokenizer

    tokenizer = train_tokenizer(tmp_path)
    proc = subprocess.run([sys.executable, str(ROOT / "tools/preprocess_data.py"), "--input",
                           str(tmp_path / "text.txt"), "--tokenizer-model", tokenizer,
                           "--output-prefix", str(tmp_path / "corpus"), "--append-eod"],
                          capture_output=True, text=True, timeout=TIMEOUT, env=_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # no warning line, no tqdm bar
    assert "\r" not in proc.stdout
    assert [line.split(":")[0] for line in proc.stdout.splitlines()] == [
        f"wrote {tmp_path / 'corpus'}.bin/.idx"]


def test_the_filter_needs_no_megatron_and_leaves_other_warnings(tmp_path):
    """Importing the tools' package imports neither torch nor megatron (a tool that needs
    neither stays light), and a warning that is not a known one still prints."""
    code = ("import sys, warnings; import megatron_boost.cli; "
            "assert 'torch' not in sys.modules and 'megatron.core' not in sys.modules; "
            "import megatron.core.optimizer; warnings.warn('a real one')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=TIMEOUT, env=_env())
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stderr.splitlines() if "Warning" in line] == [
        "<string>:1: UserWarning: a real one"]


def test_the_launcher_sets_omp_threads_without_torchruns_banner(tmp_path):
    """Two ranks through the launcher: each sees OMP_NUM_THREADS=1 unless the user set it, and
    torchrun's "Setting OMP_NUM_THREADS ..." banner is not printed."""
    script = tmp_path / "entry.py"
    script.write_text("import os, sys\n"
                      "open(sys.argv[2] + '.' + os.environ['RANK'], 'w')"
                      ".write(os.environ['OMP_NUM_THREADS'])\n")
    for env, threads in ((_env(), "1"), (_env(OMP_NUM_THREADS="3"), "3")):
        proc = subprocess.run([sys.executable, "-m", "megatron_boost.cli.launch",
                               "--nproc-per-node", "2", "--entry", str(script), "--config",
                               str(tmp_path / "out")], cwd=ROOT, capture_output=True,
                              text=True, timeout=TIMEOUT, env=env)
        assert proc.returncode == 0, proc.stderr
        assert "OMP_NUM_THREADS" not in proc.stdout + proc.stderr
        assert [(tmp_path / f"out.{rank}").read_text() for rank in (0, 1)] == [threads] * 2
