"""tools/summarize_run.py: the demo's summary lines and compare_modes.sh's table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_boost.cli.summarize_run import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_run(run_dir, records) -> str:
    """A run directory whose metrics.jsonl holds ``records`` (with a blank line, as allowed)."""
    run_dir.mkdir()
    lines = [json.dumps(r) for r in records]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    return str(run_dir)


def train_record(it: int, loss: float, tokens_per_s: float, tflops: float = 0.5) -> dict:
    return dict(iteration=it, tokens=it * 2048, loss=loss, lr=3e-4, grad_norm=1.0,
                tokens_per_s=tokens_per_s, tflops=tflops, mfu=None, tp_comm_bytes=3 * 2**20)


def eval_record(it: int, val_loss: float, val_ppl: float) -> dict:
    return dict(iteration=it, tokens=it * 2048, val_loss=val_loss, val_ppl=val_ppl)


@pytest.fixture
def run(tmp_path):
    # tokens_per_s 0 on the first record: a window without a timing, not a measurement.
    return write_run(tmp_path / "run-boost", [
        train_record(10, 6.5, 0.0, tflops=0.0),
        eval_record(10, 6.4, 601.85),
        train_record(20, 5.25, 1000.0, tflops=0.25),
        train_record(30, 4.125, 3000.0, tflops=0.75),
        eval_record(30, 4.3795, 79.8),
    ])


def test_summary_lines(run, capsys):
    assert main([run, "--valid-set", "held-out plays"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "summary: 30 iterations, 61,440 tokens | final train loss 4.1250 | "
        "mean throughput 2,000 tokens/s",
        "summary: validation (held-out plays) ppl 601.9 at iteration 10 -> 79.8 at iteration 30 "
        "(val loss 4.3795)",
    ]


def test_summary_without_validation(tmp_path, capsys):
    run = write_run(tmp_path / "r", [train_record(5, 7.0, 500.0)])
    assert main([run]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "summary: 5 iterations, 10,240 tokens | final train loss 7.0000 | "
        "mean throughput 500 tokens/s"
    ]


def test_summary_names_the_training_time_of_every_launch(tmp_path, capsys):
    """Windows of 10 steps at 0.5 s, then (a resumed launch) 5 at 2 s and 5 at 1 s: 20 s."""
    records = [dict(train_record(it, 5.0, 100.0), step_time_s=t)
               for it, t in ((10, 0.5), (15, 2.0), (20, 1.0))]
    assert main([write_run(tmp_path / "r", records)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "summary: 20 iterations, 40,960 tokens | final train loss 5.0000 | "
        "mean throughput 100 tokens/s | training time 20.0s"
    ]


def test_table(run, tmp_path, capsys):
    other = write_run(tmp_path / "run-full", [train_record(30, 4.0, 1500.0)])
    assert main(["--table", run, other, "--labels", "boost", "full"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "mode    iters     loss  val_loss   val_ppl   tokens/s TFLOP/s/dev   tp_comm/step",
        "boost      30   4.1250    4.3795     79.80      2,000         0.5       3.00 MiB",
        "full       30   4.0000       n/a       n/a      1,500         0.5       3.00 MiB",
    ]


@pytest.mark.parametrize("contents", [None, "", "\n\n", "not json\n"])
def test_missing_empty_or_bad_file_fails_clearly(tmp_path, contents):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if contents is not None:
        (run_dir / "metrics.jsonl").write_text(contents, encoding="utf-8")
    # Through the shim, as the launch scripts call it: exit status 1 and one error line.
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "summarize_run.py"),
                           str(run_dir)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("summarize_run.py: error: ")
    expected = {None: "has no metrics.jsonl", "not json\n": "is not valid JSON"}
    assert expected.get(contents, "is empty") in proc.stderr


def test_run_without_training_records_fails(tmp_path):
    run = write_run(tmp_path / "r", [eval_record(10, 6.4, 601.85)])
    with pytest.raises(SystemExit, match="no training records"):
        main([run])


def test_labels_must_match_runs(run):
    with pytest.raises(SystemExit, match="1 --labels for 2 runs"):
        main(["--table", run, run, "--labels", "boost"])
