"""The entry points' modes are TPMode members from the parse on (cli/arg_types.py), and their
labels that are not modes (``full+sp``, ``full+swiglu``) are built and read in one place
(cli/mode_labels.py); the tools read the layout a label stands for."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest

from megatron_boost.cli.arg_types import bench_mode_list, layer_mode_list, mode_list, tp_mode
from megatron_boost.cli.mode_labels import FULL_SP, FULL_SWIGLU, ModeLayout, label_of, layout_of
from megatron_boost.config.modes import TPMode

pytestmark = pytest.mark.fast  # in-process, no model built (docs/testing.md)

DEBUG = "configs/debug.yaml"


def test_mode_lists_parse_into_tpmode_members():
    parsed = mode_list("boost,full")
    assert parsed == [TPMode.BOOST, TPMode.FULL]
    assert all(type(m) is TPMode for m in parsed), parsed
    assert tp_mode("naive") is TPMode.NAIVE


def test_one_mode_names_the_modes_when_unknown():
    with pytest.raises(argparse.ArgumentTypeError, match="'fast' is not a mode.*full, naive, boost"):
        tp_mode("fast")


def test_verify_parallel_parses_its_mode_once():
    from megatron_boost.cli.verify_parallel import _parser

    args = _parser().parse_args(["--config", DEBUG, "--mode", "boost"])
    assert args.mode is TPMode.BOOST


@pytest.mark.parametrize("label, layout", [
    ("full", ModeLayout(TPMode.FULL, False)),
    ("full+sp", ModeLayout(TPMode.FULL, True)),
    ("full+swiglu", ModeLayout(TPMode.FULL, False, True)),
    ("naive", ModeLayout(TPMode.NAIVE)),
    ("boost", ModeLayout(TPMode.BOOST)),
])
def test_a_label_reads_back_into_its_layout_and_is_built_from_it(label, layout):
    assert label in bench_mode_list("full,full+sp,full+swiglu,naive,boost")
    assert layout_of(label) == layout
    assert type(layout_of(label).mode) is TPMode
    assert layout.label == label


def test_only_full_rank_has_the_extra_labels():
    assert layer_mode_list(FULL_SP) == [FULL_SP]
    with pytest.raises(argparse.ArgumentTypeError):
        layer_mode_list(FULL_SWIGLU)  # the benchmark's only
    with pytest.raises(ValueError, match="boost"):
        label_of(TPMode.BOOST, sequence_parallel=True)


def test_the_benchmark_sets_a_labels_layout():
    from megatron_boost.cli.benchmark import apply_bench_layout

    cfg = SimpleNamespace(parallel=SimpleNamespace(), model=SimpleNamespace())
    apply_bench_layout(cfg, FULL_SWIGLU)
    assert cfg.parallel.mode is TPMode.FULL
    assert (cfg.parallel.sequence_parallel, cfg.model.bias_activation_fusion) == (False, True)


def test_the_benchmark_ratios_read_rows_by_label():
    from megatron_boost.cli.benchmark import _ratios

    times = {"full": 4.0, "full+sp": 3.0, "naive": 5.0, "boost": 2.0}
    rows = [{"label": f"{name} TP=2", "step_time_median_s": t} for name, t in times.items()]
    ratios = _ratios(rows)
    assert ratios["boost/naive speed"] == times["naive"] / times["boost"]
    assert ratios["boost/full+sp speed"] == times["full+sp"] / times["boost"]
    assert ratios["boost/strongest full speed"] == ratios["boost/full+sp speed"]


def test_layer_ops_specs_follow_the_label():
    from megatron_boost.cli.layer_ops import ledger_specs
    from megatron_boost.config.run import load_run_config

    cfg = load_run_config(DEBUG, [])
    full_sp, full, boost = ledger_specs(cfg, layer_mode_list("full+sp,full,boost"), 2, 1, 16,
                                        "fp32", 2, "lowrank")
    assert (full_sp.layout.mode, full_sp.layout.sequence_parallel, full_sp.recompute) == (
        TPMode.FULL, True, None)
    assert (full.layout.mode, full.layout.sequence_parallel) == (TPMode.FULL, False)
    assert (boost.layout.mode, boost.overlap_chunks, boost.recompute) == (TPMode.BOOST, 2,
                                                                          "lowrank")
    assert all(type(spec.layout.mode) is TPMode for spec in (full_sp, full, boost))


def test_perf_model_recompute_per_mode():
    from megatron_boost.cli.perf_model import _mode_recompute

    assert _mode_recompute("lowrank", TPMode.FULL) == "full"
    assert _mode_recompute("lowrank", TPMode.NAIVE) == "lowrank"


def test_the_paper_tables_ratios_read_modes():
    from megatron_boost.cli.paper_table import MODES, _ratios

    assert MODES == tuple(TPMode) and all(type(m) is TPMode for m in MODES)
    times = {TPMode.FULL: 3.0, TPMode.NAIVE: 4.0, TPMode.BOOST: 2.0}
    rows = [{"row": "r", "mode": m, "iteration_s": t, "published_a100_s": None}
            for m, t in times.items()]
    assert _ratios(rows)["r"]["boost_vs_naive"] == round(times[TPMode.NAIVE] / times[TPMode.BOOST], 3)
