"""Plot training curves of one or more runs.

    megatron-boost-plot-runs runs/lowrank runs/full --out curves.png --labels low-rank full

(or ``python tools/plot_runs.py`` with the same arguments)

Each run directory holds ``metrics.jsonl``: one JSON object per line with ``iteration``,
``tokens``, ``loss``, ``tokens_per_s`` (and more), and ``val_loss`` on evaluation lines. The figure
has two panels, one colour per run: loss against tokens seen (training loss as a solid line,
validation loss as markers) and throughput (tokens/s) against iteration.
"""

from __future__ import annotations

import argparse
import os

from megatron_boost.cli.summarize_run import add_run_arguments, load_metrics, run_labels


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
    add_run_arguments(parser, "legend labels")
    parser.add_argument("--out", default="curves.png", help="output image (png, pdf, svg)")
    parser.add_argument("--title", default=None, help="figure title")
    return parser.parse_args(argv)


def draw(plt, runs: list[list[dict]], labels: list[str], title: str | None, out: str) -> None:
    """Loss against tokens (train line, validation markers) and tokens/s against iteration."""
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
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    labels = run_labels(args, "plot_runs.py")
    # Read every run before the (slow) matplotlib import so a bad run fails fast.
    runs = [load_metrics(r, "plot_runs.py") for r in args.runs]
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plot_runs.py: error: matplotlib is not installed; pip install matplotlib")
    matplotlib.use("Agg")  # no display needed (clusters, CI)
    import matplotlib.pyplot as plt

    draw(plt, runs, labels, args.title, args.out)
    print(f"wrote {args.out} ({len(runs)} runs)")
    return 0

