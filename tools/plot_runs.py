#!/usr/bin/env python
"""Plot training curves of one or more runs.

    python tools/plot_runs.py runs/lowrank runs/full --out curves.png --labels low-rank full

Each run directory holds ``metrics.jsonl``: one JSON object per line with ``iteration``,
``tokens``, ``loss``, ``tokens_per_s`` (and more), and ``val_loss`` on evaluation lines. The figure
has two panels, one colour per run: loss against tokens seen (training loss as a solid line,
validation loss as markers) and throughput (tokens/s) against iteration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def load_metrics(run_dir: str) -> list[dict]:
    """Read ``<run_dir>/metrics.jsonl`` into a list of records (blank lines skipped)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(
            f"plot_runs.py: error: run '{run_dir}' has no metrics.jsonl; pass run directories "
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
                raise SystemExit(f"plot_runs.py: error: {path}:{lineno} is not valid JSON ({err})")
    if not records:
        raise SystemExit(f"plot_runs.py: error: {path} is empty; the run logged no metrics yet")
    return records


def series(records: list[dict], x_key: str, y_key: str) -> tuple[list, list]:
    """The (x, y) points of the records that have both keys with non-null values."""
    points = [
        (r[x_key], r[y_key])
        for r in records
        if r.get(x_key) is not None and r.get(y_key) is not None
    ]
    return [p[0] for p in points], [p[1] for p in points]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories containing metrics.jsonl")
    parser.add_argument("--out", default="curves.png", help="output image (png, pdf, svg)")
    parser.add_argument(
        "--labels", nargs="+", help="legend labels, one per run (default: dir name)"
    )
    parser.add_argument("--title", default=None, help="figure title")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.runs):
        raise SystemExit(
            f"plot_runs.py: error: {len(args.labels)} --labels for {len(args.runs)} runs; give "
            f"one label per run or none"
        )

    labels = args.labels or [os.path.basename(os.path.normpath(r)) for r in args.runs]
    # Read every run before the (slow) matplotlib import so a bad run fails fast.
    runs = [load_metrics(r) for r in args.runs]
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plot_runs.py: error: matplotlib is not installed; pip install matplotlib")
    matplotlib.use("Agg")  # no display needed (clusters, CI)
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_tput) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (records, label) in enumerate(zip(runs, labels)):
        color = colors[i % len(colors)]
        x, y = series(records, "tokens", "loss")
        ax_loss.plot(x, y, "-", color=color, label=f"{label} train")
        x, y = series(records, "tokens", "val_loss")
        if x:
            ax_loss.plot(x, y, "o", color=color, markersize=5, label=f"{label} val")
        x, y = series(records, "iteration", "tokens_per_s")
        ax_tput.plot(x, y, "-", color=color, label=label)

    ax_loss.set(xlabel="tokens", ylabel="loss", title="loss")
    ax_tput.set(xlabel="iteration", ylabel="tokens/s", title="throughput")
    for ax in (ax_loss, ax_tput):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fig.savefig(args.out, dpi=120)
    plt.close(fig)
    print(f"wrote {args.out} ({len(runs)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
