"""Two halves of the micro-batch interleaved through one layer: the schedule priced before it is
built (docs/design.md §7, candidate (a) of the overlap designs).

The layer's kernels do not depend on the batch across sequences (causal attention mixes
positions of one sequence only), so a micro-batch of b sequences can run as two halves of b/2,
each half's collective travelling beside the other half's work. This module builds that op
stream from the ledger of ONE half (``measure/ledger.py`` at micro_batch b/2), without running
it, so that ``perf/layer_time.py`` prices it on the same two streams as every recorded layer:

* each phase's kernels are cut into segments, each ending at one of the half's collectives (the
  point where a half would hand over to the other);
* the segments alternate, half 0 first in the forward, half 1 first in the backward (autograd
  runs the later-created half's nodes first);
* the forward collectives become asynchronous, waited for by the first kernel that reads their
  result (the kernels' ``deps``); with ``backward=True`` the backward ones too, so each half's
  backward collective travels beside the other half's next segment. (In the layer as built the
  backward all-reduce of dz is waited for inside its own group, before σ'; overlapping it with
  the other half needs the wait moved to the A side's node: the all-reduce of dP instead of dz,
  equal since σ' and the norm's scale are linear in dz with replicated coefficients.)

Every kernel runs twice at half the rows, so the GEMMs and element-wise traffic are those of the
whole micro-batch, and every launch is paid twice.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Tuple

from megatron_boost.measure.ledger import LayerLedger

__all__ = ["interleave_halves"]


def _segments(ledger: LayerLedger, phase: str) -> List[List[int]]:
    """The phase's kernel indices cut after each collective."""
    segments, current = [], []
    for i, k in enumerate(ledger.kernels):
        if k.phase != phase:
            continue
        current.append(i)
        if k.kind == "collective":
            segments.append(current)
            current = []
    return segments + ([current] if current else [])


def _order(ledger: LayerLedger, backward: bool) -> List[Tuple[int, int]]:
    """(half, kernel index of the half's ledger) in the interleaved issue order."""
    order = []
    for segment in _segments(ledger, "fwd"):
        order += [(0, i) for i in segment] + [(1, i) for i in segment]
    if backward:
        for segment in _segments(ledger, "bwd"):
            order += [(1, i) for i in segment] + [(0, i) for i in segment]
    else:
        backward_kernels = [i for i, k in enumerate(ledger.kernels) if k.phase == "bwd"]
        order += [(1, i) for i in backward_kernels] + [(0, i) for i in backward_kernels]
    return order


def interleave_halves(half: LayerLedger, backward: bool = False) -> LayerLedger:
    """The layer of twice ``half``'s micro-batch run as two interleaved halves (module
    docstring): the forward collectives, and with ``backward`` the backward ones, waited for
    where a kernel first reads them; the others keep their recorded waits."""
    order = _order(half, backward)
    where: Dict[Tuple[int, int], int] = {slot: n for n, slot in enumerate(order)}
    kernels = [dataclasses.replace(half.kernels[i], deps=tuple(where[(h, d)] for d in
                                                               half.kernels[i].deps))
               for h, i in order]
    entries = {c.issued_at: c for c in half.collectives}
    collectives = []
    for h, i in order:
        if i not in entries:
            continue
        c = entries[i]
        if c.phase == "fwd" or backward:  # waited for by its readers (their deps)
            waited_at, async_op = None, True
        else:
            waited_at, async_op = _moved(c.waited_at, h, where, len(half.kernels)), c.async_op
        collectives.append(dataclasses.replace(c, issued_at=where[(h, i)], async_op=async_op,
                                               waited_at=waited_at))
    spec = dataclasses.replace(half.spec, micro_batch=2 * half.spec.micro_batch)
    return dataclasses.replace(half, spec=spec, kernels=kernels, collectives=collectives,
                               saved_bytes=2 * half.saved_bytes,
                               saved_by_scope={k: 2 * v for k, v in half.saved_by_scope.items()})


def _moved(waited_at, h: int, where: Dict[Tuple[int, int], int], n: int):
    """A recorded wait's index in the interleaved stream (None: at the layer's end)."""
    return None if waited_at is None or waited_at >= n else where[(h, waited_at)]
