"""The interleaved halves in the op ledger (``parallel.interleave_halves``, docs/design.md §7):
the real layer recorded at 7B's per-rank widths (TP=4, FakeTensors) and priced on the H100
profile's two streams (``perf/layer_time.py``).

Checked: with the halves, the layer's forward and backward all-reduces are each exposed for
less than a third of the time they are in the layer as built, and every kernel runs twice (the
same GEMM work). The layer's copies are the halves' own, outside the sub-blocks: forward, each
half's rows in and the join; backward, each half's rows of the output gradient (made contiguous
and writable at the join) and the join of dx. Negative controls: halves that do not hand over
leave the forward exposed; B sides that wait for dz at once (no dP left running for the A side)
leave the backward exposed; torch.cat for the join hands each half a strided gradient, which
fc2's B side and fc1's A side each copy.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest

from megatron_boost.config.layout import Layout
from megatron_boost.config.shape import ModelShape
from megatron_boost.measure.ledger import LedgerSpec, ledger_in_process
from megatron_boost.perf.layer_time import layer_time, profile_costs

# the BOOST paper's 7B layer at TP=4, 4 x 4096 tokens (the issue's; the depth plays no part)
SHAPE = ModelShape("wide", num_layers=2, hidden=4096, ffn=11008, heads=32, vocab=32000,
                   seq_length=4096, attn_rank=1024, mlp_rank=1024)
BUILT = LedgerSpec(shape=SHAPE, layout=Layout(mode="boost", tp=4), micro_batch=4,
                   seq_length=4096)
HALVES = dataclasses.replace(BUILT, interleave_halves=True)
COSTS = profile_costs("h100-sxm", 4)


def _timed(spec, *patches):
    import contextlib

    from megatron_boost.runtime.cpu_mode import cpu_mode_left_as_found, use_cpu

    with cpu_mode_left_as_found(), contextlib.ExitStack() as stack:
        use_cpu(force=True)
        for target, value in patches:
            stack.enter_context(mock.patch(target, value))
        ledger = ledger_in_process(spec)
    return ledger, layer_time(ledger, COSTS)


@pytest.fixture(scope="module")
def built():
    return _timed(BUILT)


@pytest.fixture(scope="module")
def halves():
    return _timed(HALVES)


def _copies(ledger):
    """(phase, scope) of every copy kernel, in issue order."""
    return [(k.phase, k.scope) for k in ledger.kernels if k.kind == "copy"]


def test_the_halves_hide_the_all_reduces_forward_and_backward(built, halves):
    (one, t_one), (two, t_two) = built, halves
    assert t_two.exposed["fwd"] < t_one.exposed["fwd"] / 3, (t_two.exposed, t_one.exposed)
    assert t_two.exposed["bwd"] < t_one.exposed["bwd"] / 3, (t_two.exposed, t_one.exposed)
    assert t_two.total() < t_one.total()
    assert two.gemm_flops() == pytest.approx(one.gemm_flops())
    assert len(two.collectives) > 2 * len([c for c in one.collectives if c.phase == "fwd"])


def test_without_the_hand_over_the_forward_stays_exposed(built):
    _, t_one = built
    _, t_two = _timed(HALVES, ("megatron_boost.parallel.bottleneck.hand_over", lambda: None))
    assert t_two.exposed["fwd"] > 0.8 * t_one.exposed["fwd"], (t_two.exposed, t_one.exposed)


def test_b_sides_that_wait_at_once_leave_the_backward_exposed(built):
    _, t_one = built
    _, t_two = _timed(HALVES, ("megatron_boost.parallel.bottleneck.reduces_after_activation",
                               lambda link: False))
    assert t_two.exposed["bwd"] > 0.8 * t_one.exposed["bwd"], (t_two.exposed, t_one.exposed)


def test_the_halves_copy_only_at_the_split_and_the_join(halves):
    """Forward: each half's rows, the join; backward: each half's output gradient, the join of
    dx. No sub-block copies a gradient (``join_halves``, parallel/interleave.py)."""
    ledger, _ = halves
    assert _copies(ledger) == [("fwd", "layer")] * 3 + [("bwd", "layer")] * 3, _copies(ledger)


def test_torch_cat_for_the_join_makes_the_sub_blocks_copy():
    """Negative control of the test above."""
    import torch

    ledger, _ = _timed(HALVES, ("megatron_boost.model.specs.join_halves",
                                lambda halves: torch.cat(halves, dim=1)))
    in_blocks = [c for c in _copies(ledger) if c[1] != "layer"]
    assert sorted(in_blocks) == [("bwd", "mlp.linear_fc1")] * 2 + [("bwd", "mlp.linear_fc2")] * 2, \
        _copies(ledger)
