"""tools/layer_ops.py's table reads without --help: a line under it explains each column.
(tools/perf_model.py's wording, "predicted" and what mb= and m= are, is checked by the CLI
tests of tests/test_perf_model.py, on the ledgers they measure anyway.)
"""

from __future__ import annotations


DEBUG = "configs/debug.yaml"


def test_layer_ops_explains_every_column(capsys):
    from megatron_boost.cli.layer_ops import main

    assert main(["--config", DEBUG, "--modes", "boost"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = next(line for line in out if line.startswith("| layer |"))
    columns = [c.strip() for c in header.strip("|").split("|")][2:]  # after layer, tp
    legend = out[out.index(header) + 3]  # under the separator and the one row
    assert legend.startswith("columns (counted from the layer's op graph, not timed"), legend
    unexplained = [c for c in columns if f"{c}: " not in legend]
    assert unexplained == [], unexplained
