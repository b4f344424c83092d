"""The op ledger in time (megatron_boost/perf/layer_time.py, docs/design.md §17).

Checked: the two-stream schedule on hand-built op streams (a collective hidden only by work
that runs beside it and does not read its result; chunks' collectives one after another on
one stream; a synchronous one exposed in full), the recorder's dependencies on a real
recorded op stream (a kernel that reads a collective's result depends on it, so it hides
nothing), and that a measured layer's time adds up. Negative controls: dependent work beside
a collective, and two collectives counted side by side, each fail a test when the schedule
ignores them.
"""

from __future__ import annotations

import pytest

from megatron_boost.measure.ledger import CollectiveEntry, LayerLedger, LedgerSpec, \
    layer_ledger
from megatron_boost.measure.op_recorder import Kernel
from megatron_boost.config.layout import Layout
from megatron_boost.config.shape import ModelShape
from megatron_boost.perf.hardware import hardware
from megatron_boost.perf.layer_time import DEVICE_PROFILES, KernelCosts, layer_time, \
    profile_costs

pytestmark = pytest.mark.fast

SMALL = ModelShape("small", num_layers=2, hidden=64, ffn=96, heads=4, query_groups=2,
                   vocab=256, seq_length=32, attn_rank=16, mlp_rank=24)
COSTS = KernelCosts(hardware("h100-80gb"), tp=4)
GEMM_FLOPS = 1e12  # about 1.4 ms at the flat roofline
COMM_BYTES = 200 * 2 ** 20  # about 0.9 ms on the link


def _gemm(deps=()):
    return Kernel("fwd", "gemm", "mm", "layer", read=0, write=0, flops=GEMM_FLOPS, deps=deps)


def _collective():
    return Kernel("fwd", "collective", "allreduce_", "layer", read=COMM_BYTES, write=0)


def _ledger(kernels, waits):
    """A ledger of ``kernels``; ``waits``: {collective's index: index of its wait}."""
    entries = [CollectiveEntry("fwd", "all_reduce", "layer", COMM_BYTES, 1, async_op=True,
                               overlap_flops=0.0, overlap_bytes=0, issued_at=i, waited_at=w)
               for i, w in waits.items()]
    return LayerLedger(spec=None, kernels=kernels, collectives=entries, saved_bytes=0,
                       saved_by_scope={}, saved_fp32_wide=[])


def _link():
    return COSTS.collective(_ledger([_collective()], {0: 1}).collectives[0])


def test_independent_work_beside_a_collective_hides_it():
    gemm = COSTS.kernel(_gemm())
    timed = layer_time(_ledger([_collective(), _gemm(), _gemm()], {0: 2}), COSTS)
    assert timed.exposed["fwd"] == pytest.approx(max(0.0, _link() - gemm))
    assert timed.total() == pytest.approx(max(_link(), gemm) + gemm)


def test_dependent_work_beside_a_collective_hides_nothing():
    """Negative control: the GEMM issued before the wait reads the collective's result, so it
    waits for it: the collective is exposed in full."""
    timed = layer_time(_ledger([_collective(), _gemm(deps=(0,)), _gemm()], {0: 2}), COSTS)
    assert timed.exposed["fwd"] == pytest.approx(_link())
    assert timed.collectives[0]["exposed_s"] == pytest.approx(_link())


def test_chunks_collectives_run_one_after_another():
    """Negative control for side-by-side collectives: two chunks' collectives issued together
    and waited for after one GEMM end one link time apart (one communication stream), so the
    second is exposed by two link times less the GEMM (the shapes make that positive)."""
    kernels = [_collective(), _collective(), _gemm(), _gemm()]
    timed = layer_time(_ledger(kernels, {0: 3, 1: 3}), COSTS)
    gemm = COSTS.kernel(_gemm())
    assert _link() < gemm < 2 * _link()
    assert timed.exposed["fwd"] == pytest.approx(2 * _link() - gemm)
    assert timed.total() == pytest.approx(2 * _link() + gemm)


def test_a_synchronous_collective_is_exposed_in_full():
    timed = layer_time(_ledger([_gemm(), _collective(), _gemm()], {1: 2}), COSTS)
    assert timed.exposed["fwd"] == pytest.approx(_link())


def test_a_recorded_kernel_reading_a_collectives_result_depends_on_it():
    """On a real recorded layer: every asynchronous collective's overlapping FLOPs come only
    from kernels that do not read its result, and the kernels that consume a forward
    all-reduce's product (boost's σ) list it among their dependencies."""
    ledger = layer_ledger(LedgerSpec(shape=SMALL, layout=Layout(mode="boost", tp=2), seq_length=32))
    for c in ledger.collectives:
        readers = [k for k in ledger.kernels if c.issued_at in k.deps]
        assert readers, c
        assert all(ledger.kernels.index(k) > c.issued_at for k in readers)
    sync_fwd = [c for c in ledger.collectives if c.phase == "fwd" and not c.async_op]
    assert sync_fwd and all(c.overlap_flops == 0 for c in sync_fwd)


@pytest.mark.parametrize("profile", list(DEVICE_PROFILES))
def test_a_measured_layer_adds_up_at_every_profile(profile):
    """The compute stream's classes and the exposed communication add up to the total; the
    exposed time is the collectives' own, and no more than their time on the link."""
    ledger = layer_ledger(LedgerSpec(shape=SMALL, layout=Layout(mode="boost", tp=2), seq_length=32))
    timed = layer_time(ledger, profile_costs(profile, 2))
    parts = sum(timed.seconds(c) for c in ("gemm", "attention", "traffic", "exposed_comm"))
    assert timed.total() == pytest.approx(parts)
    exposed = sum(row["exposed_s"] for row in timed.collectives)
    assert timed.seconds("exposed_comm") == pytest.approx(exposed)
    assert exposed <= sum(row["link_s"] for row in timed.collectives) + 1e-12
    assert timed.launches == len([k for k in ledger.kernels if k.kind != "collective"])


def test_an_unknown_profile_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="h100-sxm"):
        profile_costs("h800", 4)
