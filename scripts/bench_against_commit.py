#!/usr/bin/env python3
"""The CPU benchmark of this checkout against an earlier commit, side by side.

    python scripts/bench_against_commit.py --commit 5398f43 --runs 3 --out result.txt

Checks the commit out into a temporary git worktree, then runs ``tools/benchmark.py`` (full,
naive and boost at TP=2 on ``configs/bench-cpu.yaml``) alternately there and here, ``--runs``
times each (earlier, this, earlier, this, ...), so that the machine's drift between runs hits
both alike. Writes each run's step times and ratios, then the medians: each mode's step time
here over the same mode's in the run of the earlier commit just before it, and each tree's
boost/full and boost/naive speed-ups. The worktree is removed afterwards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("full", "naive", "boost")


def _bench(tree: Path, out: Path, steps: int) -> dict:
    """One benchmark run of ``tree``'s code; its JSON report."""
    env = dict(os.environ, PYTHONPATH=str(tree))  # that tree's package, in every rank too
    subprocess.run([sys.executable, str(tree / "tools/benchmark.py"), "--config",
                    str(tree / "configs/bench-cpu.yaml"), "--tp", "2", "--modes",
                    ",".join(MODES), "--steps", str(steps), "--warmup", "2", "--json",
                    str(out)], cwd=tree, env=env, check=True, timeout=1800,
                   stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    return {label.split()[0]: row["step_time_median_s"] for label, row in report["modes"].items()}


def _line(tag: str, times: dict) -> str:
    return (f"{tag:<8}" + "".join(f"{times[m]:>9.3f}" for m in MODES)
            + f"{times['full'] / times['boost']:>14.2f}{times['naive'] / times['boost']:>15.2f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commit", required=True, help="the earlier commit")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", required=True, help="the text result")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp())
    old = work / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(old), args.commit], cwd=ROOT,
                   check=True, timeout=120, stdout=subprocess.DEVNULL)
    pairs = []
    try:
        for i in range(args.runs):
            pairs.append((_bench(old, work / f"old{i}.json", args.steps),
                          _bench(ROOT, work / f"new{i}.json", args.steps)))
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT,
                       timeout=120)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, timeout=60,
                          capture_output=True, text=True).stdout.strip()
    lines = [f"$ python scripts/bench_against_commit.py --commit {args.commit} --runs "
             f"{args.runs} --steps {args.steps}",
             f"CPU benchmark (configs/bench-cpu.yaml, TP=2, fp32, {args.steps} timed steps after "
             f"2): commit {args.commit} ('before') and this checkout ({head}, 'after') run in "
             f"turn; step s (median of the run's steps)",
             f"{'run':<8}" + "".join(f"{m:>9}" for m in MODES)
             + f"{'boost/full':>14}{'boost/naive':>15}"]
    for i, (before, after) in enumerate(pairs, 1):
        lines += [_line(f"before{i}", before), _line(f"after{i}", after)]
    med = statistics.median
    ratio = {m: med(a[m] / b[m] for b, a in pairs) for m in MODES}
    lines.append("median of after/before step time, pair by pair: "
                 + ", ".join(f"{m} {ratio[m]:.3f}" for m in MODES))
    for tag, k in (("before", 0), ("after", 1)):
        lines.append(f"median {tag}: boost/full {med(p[k]['full'] / p[k]['boost'] for p in pairs):.2f}x,"
                     f" boost/naive {med(p[k]['naive'] / p[k]['boost'] for p in pairs):.2f}x")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
