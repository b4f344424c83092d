"""The paper's table: its configs pass ``--check`` at every row's layout in every mode."""

from __future__ import annotations

import pytest

from megatron_boost.analysis.shape import MODES
from megatron_boost.cli.pretrain import main as pretrain_main
from megatron_boost.perf.published import PAPER_ROWS


@pytest.mark.fast
@pytest.mark.parametrize("row", sorted(PAPER_ROWS))
def test_paper_config_passes_check_at_its_layout_in_every_mode(row, capsys):
    config, tp, pp, _ = PAPER_ROWS[row]
    for mode in MODES:
        code = pretrain_main(["--check", "--world-size", str(tp * pp), "--config", config,
                              f"parallel.mode={mode}", f"parallel.tp={tp}", f"parallel.pp={pp}"])
        assert code == 0, f"{row} {mode}: {capsys.readouterr()}"
