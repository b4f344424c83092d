"""One layout record (megatron_boost/config/layout.py): the run configuration, the perf model,
the ledger, the per-layer comm measurement and the layout-equivalence harness compose it rather
than repeating the mode, the parallel sizes and sequence parallelism in records of their own."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_boost.config.layout import Layout
from megatron_boost.config.modes import TPMode
from megatron_boost.config.run import ParallelConfig
from megatron_boost.config.shape import ModelShape
from megatron_boost.measure.layer_comm import LayerCommSpec
from megatron_boost.measure.ledger import LedgerSpec
from megatron_boost.perf import model as perf
from megatron_boost.testing.verification import LayoutSpec

pytestmark = pytest.mark.fast

SHAPE = ModelShape(name="tiny", num_layers=1, hidden=64, ffn=172, heads=4)

LAYOUT_FIELDS = [f.name for f in dataclasses.fields(Layout)]
#: The records that hold the layout as a field.
HOLDERS = [LedgerSpec, LayerCommSpec, LayoutSpec]


@pytest.mark.parametrize("record", HOLDERS, ids=lambda r: r.__name__)
def test_each_spec_holds_the_one_layout_and_no_copy_of_its_fields(record):
    fields = {f.name: f for f in dataclasses.fields(record)}
    assert fields["layout"].type in (Layout, "Layout"), fields["layout"].type
    copies = [name for name in LAYOUT_FIELDS if name in fields]
    assert copies == [], f"{record.__name__} repeats the layout's {copies}"


def test_the_perf_layout_extends_the_record_and_inherits_its_mode_and_sizes():
    assert issubclass(perf.Layout, Layout)
    own = perf.Layout.__dict__.get("__annotations__", {})
    # dp and vpp are redeclared for their defaults only (the model prices a known dp, vpp 1)
    assert [name for name in LAYOUT_FIELDS if name in own] == ["vpp", "dp"]
    assert set(LAYOUT_FIELDS) <= {f.name for f in dataclasses.fields(perf.Layout)}


def test_the_parallel_section_builds_the_record_from_its_flat_fields():
    par = ParallelConfig(mode="naive", tp=2, pp=2, vpp=3, dp=4, sequence_parallel=False)
    layout = par.layout
    assert type(layout) is Layout
    assert {name: getattr(layout, name) for name in LAYOUT_FIELDS} == {
        name: getattr(par, name) for name in LAYOUT_FIELDS}
    assert layout.mode is TPMode.NAIVE
    # the YAML section keeps its flat keys: the record is no field of it
    assert "layout" not in {f.name for f in dataclasses.fields(ParallelConfig)}


@pytest.mark.parametrize("build", [
    lambda layout: layout,
    lambda layout: ParallelConfig(mode=layout.mode.value, tp=layout.tp).layout,
    lambda layout: perf.Layout(mode=layout.mode.value, tp=layout.tp),
    lambda layout: LedgerSpec(shape=SHAPE, layout=layout).layout,
    lambda layout: LayerCommSpec(layout=layout).layout,
    lambda layout: LayoutSpec(layout=layout).layout,
], ids=["Layout", "ParallelConfig", "perf.Layout", "LedgerSpec", "LayerCommSpec", "LayoutSpec"])
def test_every_record_reads_the_mode_as_the_enum(build):
    layout = build(Layout(mode="full", tp=2))
    assert isinstance(layout, Layout)
    assert layout.mode is TPMode.FULL
    assert layout.resolved_sequence_parallel  # full at tp 2: megatron's default, on


def test_a_bad_mode_is_refused_where_the_record_is_built():
    with pytest.raises(ValueError, match=r"tp_mode \('sideways'\) must be one of"):
        Layout(mode="sideways")


def test_the_ledgers_json_form_keeps_the_layout_flat():
    """tools/layer_ops.py --json writes the spec flat, as before the record: mode, tp and
    sequence_parallel at the top level (None reads as off: the ledger's default)."""
    spec = LedgerSpec(shape=SHAPE, layout=Layout(mode="boost", tp=2), seq_length=32)
    flat = spec.to_dict()
    assert "layout" not in flat
    assert (flat["mode"], flat["tp"], flat["sequence_parallel"]) == ("boost", 2, False)
    rest = {k: v for k, v in dataclasses.asdict(spec).items() if k != "layout"}
    assert {k: flat[k] for k in rest} == rest
