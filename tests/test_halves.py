"""Two halves of the micro-batch interleaved through a boost layer, priced from the ledger of one
half (megatron_boost/perf/halves.py, docs/design.md §7).

Checked on a recorded boost layer at 7B-like per-rank widths: the interleaved stream holds every
kernel of the half exactly twice, each half's kernels keep their own order and read only their
own half's collectives, and the halves alternate at the collectives; priced on the H100 profile,
the same work (GEMM and traffic time twice the half's) with less exposed communication than
the two halves run one after the other, forward and, with ``backward``, backward. Negative
control: with the segments not alternated (the halves back to back) the pricing test fails.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from megatron_boost.config.layout import Layout
from megatron_boost.config.shape import ModelShape
from megatron_boost.measure.ledger import LedgerSpec, layer_ledger
from megatron_boost.perf.halves import interleave_halves
from megatron_boost.perf.layer_time import layer_time, profile_costs

# 7B's per-rank widths at TP=4 (the collectives' bytes matter here, not the depth)
SHAPE = ModelShape("wide", num_layers=2, hidden=4096, ffn=11008, heads=32, vocab=32000,
                   seq_length=2048, attn_rank=1024, mlp_rank=1024)
HALF = LedgerSpec(shape=SHAPE, layout=Layout(mode="boost", tp=4), micro_batch=1,
                  seq_length=2048)
COSTS = profile_costs("h100-sxm", 4)


@pytest.fixture(scope="module")
def half():
    return layer_ledger(HALF)


def _back_to_back(half):
    """The two halves one after the other: the half's op stream twice (the same seconds as the
    half's, twice)."""
    return layer_time(half, COSTS)


def test_the_interleaved_stream_is_the_halfs_kernels_twice_in_alternating_segments(half):
    both = interleave_halves(half)
    assert Counter(k.name for k in both.kernels) == Counter(
        {name: 2 * n for name, n in Counter(k.name for k in half.kernels).items()})
    assert both.spec.micro_batch == 2 * HALF.micro_batch
    fwd = [c for c in both.collectives if c.phase == "fwd"]
    assert len(fwd) == 2 * len([c for c in half.collectives if c.phase == "fwd"])
    assert all(c.async_op and c.waited_at is None for c in fwd)
    # the second half's first collective is issued before the first half reads its own
    first, second = fwd[0], fwd[1]
    readers_of_first = [i for i, k in enumerate(both.kernels) if first.issued_at in k.deps]
    assert second.issued_at < min(readers_of_first)
    # each kernel reads collectives issued before it
    for i, k in enumerate(both.kernels):
        assert all(d < i and both.kernels[d].kind == "collective" for d in k.deps)


def test_interleaving_hides_communication_behind_the_other_half(half):
    one = _back_to_back(half)
    forward_only = layer_time(interleave_halves(half), COSTS)
    both_phases = layer_time(interleave_halves(half, backward=True), COSTS)
    for t in (forward_only, both_phases):  # the same work, twice the half's
        assert t.seconds("gemm") == pytest.approx(2 * one.seconds("gemm"))
        assert t.seconds("traffic") == pytest.approx(2 * one.seconds("traffic"))
        assert t.launches == 2 * one.launches
    assert forward_only.exposed["fwd"] < 0.6 * 2 * one.exposed["fwd"]
    assert forward_only.exposed["bwd"] == pytest.approx(2 * one.exposed["bwd"])
    assert both_phases.exposed["bwd"] < 0.6 * 2 * one.exposed["bwd"]
    assert both_phases.total() < forward_only.total() < 2 * one.total()
