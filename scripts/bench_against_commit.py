#!/usr/bin/env python3
"""The CPU benchmark of this checkout against an earlier commit, side by side.

    python scripts/bench_against_commit.py --commit 5398f43 --runs 3 --out result.txt

Checks the commit out into a temporary git worktree, then runs ``tools/benchmark.py`` (full,
naive and boost at TP=2 on ``configs/bench-cpu.yaml``) alternately there and here, ``--runs``
times each (earlier, this, earlier, this, ...), so that the machine's drift between runs hits
both alike. Writes each run's step times and ratios, then the medians: each mode's step time
here over the same mode's in the run of the earlier commit just before it, and each tree's
boost/full and boost/naive speed-ups. The worktree and the runs' raw reports are removed
afterwards, on success or failure (``--raw DIR`` keeps the reports there).

Checked before anything is built: ``--out`` (and ``--raw``) can be written, the commit exists
and has the benchmark. A checkout with uncommitted changes is measured as it is and labelled
``<HEAD>-dirty`` (never as the clean HEAD).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's package, for its argument checks

from megatron_boost.cli.arg_types import output_file, positive_int  # noqa: E402
from megatron_boost.cli.errors import one_line_errors  # noqa: E402

MODES = ("full", "naive", "boost")
#: What an earlier commit must hold for the benchmark to run there.
NEEDED = ("tools/benchmark.py", "configs/bench-cpu.yaml")


def _git(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=check)


def resolve_commit(commit: str) -> str:
    """The full hash of ``commit``; ValueError when it names no commit here, or one from before
    the benchmark existed."""
    found = _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}", check=False)
    if found.returncode or not found.stdout.strip():
        raise ValueError(f"--commit '{commit}' names no commit of this repository; give a "
                         f"hash, tag or branch (git log --oneline lists them)")
    full = found.stdout.strip()
    missing = [p for p in NEEDED
               if _git("cat-file", "-e", f"{full}:{p}", check=False).returncode]
    if missing:
        raise ValueError(f"--commit '{commit}' is from before the benchmark existed: it has no "
                         f"{' or '.join(missing)}; choose a later commit")
    return full


def checkout_label() -> str:
    """This checkout's short HEAD, ``-dirty`` appended when files differ from it (tracked
    changes or untracked files that git does not ignore): what is measured is not HEAD."""
    head = _git("rev-parse", "--short", "HEAD").stdout.strip()
    changed = _git("status", "--porcelain").stdout.splitlines()
    return f"{head}-dirty ({len(changed)} files differ from {head})" if changed else head


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


def measure_pairs(commit: str, runs: int, steps: int, raw: Path) -> list:
    """``runs`` (earlier, this) pairs of step times; the commit's worktree lives in a
    temporary folder removed afterwards, whatever happens; the reports are written to
    ``raw``."""
    with tempfile.TemporaryDirectory(prefix="bench-against-commit-") as work:
        old = Path(work) / "tree"
        _git("worktree", "add", "--detach", str(old), commit)
        try:
            return [(_bench(old, raw / f"before{i}.json", steps),
                     _bench(ROOT, raw / f"after{i}.json", steps)) for i in range(1, runs + 1)]
        finally:
            _git("worktree", "remove", "--force", str(old), check=False)
            _git("worktree", "prune", check=False)


def report_lines(args, pairs: list, label: str) -> list:
    lines = [f"$ python scripts/bench_against_commit.py --commit {args.commit} --runs "
             f"{args.runs} --steps {args.steps}",
             f"CPU benchmark (configs/bench-cpu.yaml, TP=2, fp32, {args.steps} timed steps after "
             f"2): commit {args.commit} ('before') and this checkout ({label}, 'after') run in "
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
    return lines


def _raw_folder(text: str) -> str:
    """``--raw``: a folder to keep the reports in (created), not an existing file."""
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"'{text}' is a file; give a folder")
    if os.path.isdir(text):
        output_file(os.path.join(text, "report.json"))  # a file can be created in it
    else:
        output_file(text)  # the folder can be created
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commit", required=True, help="the earlier commit")
    parser.add_argument("--runs", type=positive_int, default=3)
    parser.add_argument("--steps", type=positive_int, default=6)
    parser.add_argument("--out", required=True, type=output_file,
                        help="the text result (checked before anything is built)")
    parser.add_argument("--raw", type=_raw_folder, default=None,
                        help="keep each run's benchmark report (JSON) in this folder; by "
                             "default they are removed with the worktree")
    return parser


@one_line_errors
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    commit = resolve_commit(args.commit)  # before any worktree is built
    label = checkout_label()
    if args.raw:
        Path(args.raw).mkdir(exist_ok=True)
        pairs = measure_pairs(commit, args.runs, args.steps, Path(args.raw))
    else:
        raw = Path(tempfile.mkdtemp(prefix="bench-against-commit-raw-"))
        try:
            pairs = measure_pairs(commit, args.runs, args.steps, raw)
        finally:
            shutil.rmtree(raw, ignore_errors=True)
    lines = report_lines(args, pairs, label)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
