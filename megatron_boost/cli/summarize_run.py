"""Summarize training runs from their ``metrics.jsonl``.

    megatron-boost-summarize-run runs/demo-shakespeare --valid-set "held-out plays"
    megatron-boost-summarize-run --table runs/x-full runs/x-naive runs/x-boost \\
        --labels full naive boost

(or ``python tools/summarize_run.py`` with the same arguments)

Without ``--table``: two ``summary:`` lines per run (iterations, tokens, final training loss,
mean throughput, training time when the records time their steps; first and last validation
perplexity). With ``--table``: one row per run
(iterations, final loss, last validation loss and perplexity, mean tokens/s and TFLOP/s per
device, TP communication per step). Records are those the trainer writes
(``megatron_boost/train/metrics.py``): training records carry ``loss``, evaluation records
``val_loss`` and ``val_ppl``.
"""

from __future__ import annotations

import argparse
import json
import os

PROG = "summarize_run.py"


def load_metrics(run_dir: str, prog: str = PROG) -> list[dict]:
    """Read ``<run_dir>/metrics.jsonl`` into a list of records (blank lines skipped).

    A missing file, a line that is not JSON and a file without records end the program with
    ``<prog>: error: ...``.
    """
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(
            f"{prog}: error: run '{run_dir}' has no metrics.jsonl; pass run directories "
            f"written by the trainer (the folder that contains metrics.jsonl)"
        )
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise SystemExit(f"{prog}: error: {path}:{lineno} is not valid JSON ({err})")
    if not records:
        raise SystemExit(f"{prog}: error: {path} is empty; the run logged no metrics yet")
    return records


def add_run_arguments(parser: argparse.ArgumentParser, labels_help: str) -> None:
    """The positional run directories and their optional ``--labels``."""
    parser.add_argument("runs", nargs="+", help="run directories containing metrics.jsonl")
    parser.add_argument(
        "--labels", nargs="+", help=f"{labels_help}, one per run (default: dir name)"
    )


def run_labels(args: argparse.Namespace, prog: str = PROG) -> list[str]:
    """``--labels`` (one per run, checked) or the runs' directory names."""
    if args.labels is None:
        return [os.path.basename(os.path.normpath(r)) for r in args.runs]
    if len(args.labels) != len(args.runs):
        raise SystemExit(
            f"{prog}: error: {len(args.labels)} --labels for {len(args.runs)} runs; give one "
            f"label per run or none"
        )
    return args.labels


def split_records(run_dir: str) -> tuple[list[dict], list[dict]]:
    """(training records, evaluation records) of one run; a run without training records fails."""
    records = load_metrics(run_dir)
    train = [r for r in records if r.get("loss") is not None]
    evals = [r for r in records if r.get("val_loss") is not None]
    if not train:
        raise SystemExit(
            f"{PROG}: error: {run_dir}/metrics.jsonl has no training records (no 'loss'); "
            f"the run has not logged an iteration yet"
        )
    return train, evals


def mean_of(records: list[dict], key: str) -> float:
    """Mean of ``key`` over the records that measured it (a 0 or null value is no measurement)."""
    values = [r[key] for r in records if r.get(key)]
    return sum(values) / len(values) if values else 0.0


def training_seconds(train: list[dict]) -> float | None:
    """Time spent in training steps, over every launch of the run: each record's mean step
    time times the steps of its log window (None when the records do not time their steps)."""
    if not all("step_time_s" in r for r in train):
        return None
    iterations = [0] + [r["iteration"] for r in train]
    return sum(r["step_time_s"] * (it - before)
               for r, before, it in zip(train, iterations, iterations[1:]))


def summary_lines(run_dir: str, valid_set: str) -> list[str]:
    """The two ``summary:`` lines of one run (the second only when it was validated)."""
    train, evals = split_records(run_dir)
    last = train[-1]
    seconds = training_seconds(train)
    lines = [
        f"summary: {last['iteration']} iterations, {last['tokens']:,} tokens | final train loss "
        f"{last['loss']:.4f} | mean throughput {mean_of(train, 'tokens_per_s'):,.0f} tokens/s"
        + ("" if seconds is None else f" | training time {seconds:,.1f}s")
    ]
    if evals:
        first, final = evals[0], evals[-1]
        lines.append(
            f"summary: validation ({valid_set}) ppl {first['val_ppl']:.1f} at iteration "
            f"{first['iteration']} -> {final['val_ppl']:.1f} at iteration {final['iteration']} "
            f"(val loss {final['val_loss']:.4f})"
        )
    return lines


TABLE_HEADER = (
    f"{'mode':<6} {'iters':>6} {'loss':>8} {'val_loss':>9} {'val_ppl':>9} {'tokens/s':>10} "
    f"{'TFLOP/s/dev':>11} {'tp_comm/step':>14}"
)


def table_row(run_dir: str, label: str) -> str:
    """One row of the comparison table: final values and means over the training records."""
    train, evals = split_records(run_dir)
    last = train[-1]
    val_loss = f"{evals[-1]['val_loss']:.4f}" if evals else "n/a"
    val_ppl = f"{evals[-1]['val_ppl']:.2f}" if evals else "n/a"
    return (
        f"{label:<6} {last['iteration']:>6} {last['loss']:>8.4f} {val_loss:>9} {val_ppl:>9} "
        f"{mean_of(train, 'tokens_per_s'):>10,.0f} {mean_of(train, 'tflops'):>11.3g} "
        f"{last['tp_comm_bytes'] / 2**20:>10.2f} MiB"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, "--table row labels")
    parser.add_argument("--table", action="store_true", help="one table row per run")
    parser.add_argument(
        "--valid-set", default="held-out data", help="name of the validation data in the summary"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    labels = run_labels(args)
    if args.table:
        lines = [TABLE_HEADER] + [table_row(r, label) for r, label in zip(args.runs, labels)]
    else:
        lines = [line for r in args.runs for line in summary_lines(r, args.valid_set)]
    print("\n".join(lines))
    return 0
