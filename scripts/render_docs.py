#!/usr/bin/env python3
"""Refresh the generated blocks of README.md and docs/*.md from committed result files.

Every figure the documentation shows comes from a file under ``docs/results/`` that a stated
command writes (``scripts/regenerate_results.sh`` runs them all). A generated block looks like

    <!-- generated: include docs/results/comm-volume-cola-7b.txt -->
    ...                        (replaced by this script)
    <!-- end generated -->

Kinds of block:

* ``include PATH``: the file's text in a fenced ``text`` block;
* ``bench PATH [PATH ...]``: a Markdown table of CPU-benchmark JSON files written by
  ``tools/benchmark.py --json`` (step time, tokens/s, TP traffic, saved activations per row;
  then the speed ratios of each file, the saved activations of full rank with and without
  sequence parallelism against boost when a file measured all three, and the low-rank
  recompute overhead when a file was measured with ``--recompute lowrank`` beside one without);
* ``placement``: the placement table (``megatron_boost/config/placement.py``) as Markdown;
* ``paper-table PATH``: the paper-table report (JSON) written by ``tools/paper_table.py
  --json``, as that tool prints it (``megatron_boost.cli.paper_table.markdown_table``);
* ``ledger PATH [PATH ...]``: the op ledgers written by ``tools/layer_ops.py --json``, one row
  per layer (``megatron_boost.measure.ledger.ledger_table``);
* ``ledger-change BEFORE AFTER``: each layer of AFTER beside the same layer of BEFORE.

    python scripts/render_docs.py            # rewrite the blocks in place
    python scripts/render_docs.py --check    # exit 1, naming each stale block, if any differs

``tests/test_docs.py`` runs ``--check``, so a figure cannot drift from its file.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the package of this checkout (the placement block)
    sys.path.insert(0, str(ROOT))
BLOCK = re.compile(r"(<!-- generated: (?P<spec>[^>]*?) -->\n)(?P<body>.*?)(<!-- end generated -->)",
                   re.S)
MIB = 1024 * 1024


def documents(root: Path) -> List[Path]:
    """README.md and every Markdown file under docs/."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _include(root: Path, path: str) -> str:
    text = (root / path).read_text().rstrip("\n")
    return f"```text\n{text}\n```\n"


def _bench_rows(report: dict) -> List[str]:
    rows = []
    for label, row in report["modes"].items():
        if row.get("step_time_median_s") is None:
            continue
        rows.append(f"| {label} | {report['recompute']} | {row['step_time_median_s']:.3f} | "
                    f"{row['tokens_per_s']:,.0f} | {row['tp_comm_bytes_per_step'] / MIB:.1f} | "
                    f"{row['saved_activation_bytes_per_microbatch'] / MIB:.1f} |")
    return rows


def _recompute_overhead(reports: List[dict]) -> List[str]:
    """Step time and saved activations with ``--recompute lowrank`` against the same rows
    measured without recompute (the last report whose recompute is ``none``: the one
    measured right beside it)."""
    base = next((r for r in reversed(reports) if r["recompute"] == "none"), None)
    lines = []
    for rep in reports:
        if rep["recompute"] != "lowrank" or base is None:
            continue
        for label, row in rep["modes"].items():
            ref = base["modes"].get(label)
            if ref is None or row.get("step_time_median_s") is None:
                continue
            time_ratio = row["step_time_median_s"] / ref["step_time_median_s"]
            mem_ratio = (row["saved_activation_bytes_per_microbatch"]
                         / ref["saved_activation_bytes_per_microbatch"])
            lines.append(f"- {label} with low-rank recompute: step time {time_ratio:.2f}x "
                         f"({(time_ratio - 1) * 100:+.0f}%), saved activations "
                         f"{mem_ratio:.2f}x")
    return lines


def _full_sp_saved_activations(reports: List[dict]) -> List[str]:
    """Saved activations per micro-batch of full rank with sequence parallelism (megatron's
    layout) against full without it (the BOOST paper's) and boost, from the report that
    measured all three side by side."""
    lines = []
    for rep in reports:
        rows = {label.split()[0]: row for label, row in rep["modes"].items()
                if row.get("saved_activation_bytes_per_microbatch") and " single" not in label}
        if not {"full", "full+sp", "boost"} <= set(rows):
            continue
        mib = {k: rows[k]["saved_activation_bytes_per_microbatch"] / MIB
               for k in ("full", "full+sp", "boost")}
        lines.append(f"- saved activations per micro-batch (max over ranks): full+sp "
                     f"{mib['full+sp']:.1f} MiB, full {mib['full']:.1f} MiB, boost "
                     f"{mib['boost']:.1f} MiB; boost/full+sp {mib['boost'] / mib['full+sp']:.2f}x")
    return lines


def _bench(root: Path, *paths: str) -> str:
    reports = [json.loads((root / p).read_text()) for p in paths]
    out = ["| run | recompute | step s (median) | tokens/s | TP comm MiB/step | "
           "saved act. MiB/micro-batch |", "|---|---|---|---|---|---|"]
    for rep in reports:
        out += _bench_rows(rep)
    out.append("")
    for path, rep in zip(paths, reports):
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in rep["ratios"].items() if v is not None)
        if ratios:
            out.append(f"- `{path}` ({rep['steps']} timed steps, recompute "
                       f"{rep['recompute']}): {ratios}")
    out += _full_sp_saved_activations(reports)
    out += _recompute_overhead(reports)
    return "\n".join(out) + "\n"


def _placement(root: Path) -> str:
    """The placement table of ``megatron_boost/config/placement.py`` (no result file: the
    table is code, and the block shows it as it reads there)."""
    from megatron_boost.config.placement import placement_markdown

    return placement_markdown() + "\n"


def _paper_table(root: Path, path: str) -> str:
    sys.path.insert(0, str(root))  # the repository's package, as the tools import it
    from megatron_boost.cli.paper_table import markdown_table

    return markdown_table(json.loads((root / path).read_text()))


def _ledgers(root: Path, *paths: str) -> List[dict]:
    return [entry for p in paths for entry in json.loads((root / p).read_text())]


def _ledger(root: Path, *paths: str) -> str:
    """The op ledgers of ``tools/layer_ops.py --json`` files, one row per layer."""
    from megatron_boost.measure.ledger import ledger_table

    return ledger_table(_ledgers(root, *paths)) + "\n"


def _ledger_change(root: Path, before: str, after: str) -> str:
    """Each layer of ``after`` beside the same layer (mode, TP, sequence parallelism) of
    ``before``: the figures a change of the layers moves, before -> after."""
    from megatron_boost.measure.ledger import spec_label

    def key(entry):
        spec = entry["spec"]
        return spec["mode"], spec["tp"], spec["sequence_parallel"], spec["recompute"]

    old = {key(e): e for e in _ledgers(root, before)}
    lines = ["| layer | tp | kernels fwd+bwd | elementwise+copy GB | layout copies outside "
             "attention | exposed collectives MiB | saved GiB | fp32 [T, >1] saved GiB |",
             "|---|---|---|---|---|---|---|---|"]

    def pair(a, b, fmt):
        return f"{fmt(a)} → {fmt(b)}"

    for entry in _ledgers(root, after):
        prev = old.get(key(entry))
        if prev is None:
            continue
        s0, s1 = prev["summary"], entry["summary"]
        lines.append(" | ".join([
            f"| {spec_label(entry['spec'])}", str(entry["spec"]["tp"]),
            pair(s0["total"]["kernels"], s1["total"]["kernels"], str),
            pair(s0["total"]["traffic_bytes"], s1["total"]["traffic_bytes"],
                 lambda b: f"{b / 1e9:.2f}"),
            pair(s0["layout_copies_outside_attention"], s1["layout_copies_outside_attention"],
                 str),
            pair(s0["collectives_exposed_bytes"], s1["collectives_exposed_bytes"],
                 lambda b: f"{b / 2 ** 20:.0f}"),
            pair(s0["saved_bytes"], s1["saved_bytes"], lambda b: f"{b / 2 ** 30:.2f}"),
            pair(s0["saved_fp32_wide_bytes"], s1["saved_fp32_wide_bytes"],
                 lambda b: f"{b / 2 ** 30:.2f}")]) + " |")
    return "\n".join(lines) + "\n"


def _ledger_time(root: Path, *paths: str) -> str:
    """The op ledgers of ``tools/layer_ops.py --json`` files in time, one table per device
    profile (``perf/layer_time.py``)."""
    from megatron_boost.measure.ledger import ledger_from_dict, spec_label
    from megatron_boost.perf.layer_time import (DEVICE_PROFILES, layer_time, profile_costs,
                                                time_table)

    ledgers = [ledger_from_dict(e) for e in _ledgers(root, *paths)]
    tables = []
    for profile in DEVICE_PROFILES:
        rows = [(spec_label(lg.spec), layer_time(lg, profile_costs(profile, lg.spec["tp"])))
                for lg in ledgers]
        tables.append(time_table(rows, profile))
    return "\n\n".join(tables) + "\n"


RENDERERS = {"ledger-time": _ledger_time, "include": _include, "bench": _bench, "placement": _placement,
             "paper-table": _paper_table, "ledger": _ledger, "ledger-change": _ledger_change}


def render_block(root: Path, spec: str) -> str:
    kind, *args = spec.split()
    if kind not in RENDERERS:
        raise ValueError(f"unknown generated block kind {kind!r} (known: {sorted(RENDERERS)})")
    return RENDERERS[kind](root, *args)


def render(root: Path, text: str) -> str:
    """``text`` with every generated block's body replaced by its rendering."""
    return BLOCK.sub(lambda m: m.group(1) + render_block(root, m.group("spec"))
                     + m.group(4), text)


def stale_blocks(root: Path) -> Dict[str, List[str]]:
    """{document: [spec of each block whose body differs from its rendering]}."""
    stale = {}
    for doc in documents(root):
        if not doc.exists():
            continue
        for m in BLOCK.finditer(doc.read_text()):
            if m.group("body") != render_block(root, m.group("spec")):
                stale.setdefault(str(doc.relative_to(root)), []).append(m.group("spec"))
    return stale


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="report stale blocks, change nothing")
    parser.add_argument("--root", default=str(ROOT), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    root = Path(args.root)
    if args.check:
        stale = stale_blocks(root)
        for doc, specs in stale.items():
            for spec in specs:
                print(f"error: {doc}: the block '{spec}' differs from its file; "
                      f"run python scripts/render_docs.py", file=sys.stderr)
        return 1 if stale else 0
    for doc in documents(root):
        if doc.exists():
            text = doc.read_text()
            new = render(root, text)
            if new != text:
                doc.write_text(new)
                print(f"updated {doc.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
