"""Two halves of the micro-batch interleaved through a decoder layer (docs/design.md §7,
``parallel.interleave_halves``).

Causal attention mixes the positions of one sequence only, so a layer's forward on b sequences
is its forward on the first b/2 and on the last b/2, side by side. :func:`run_halves` runs
megatron's own layer forward once per half, each in a greenlet (a coroutine with its own
Python stack, on the calling thread: one CUDA stream, one issue order), and the halves hand over
at :func:`hand_over`, which boost's A side calls right after it STARTS its forward all-reduce
(``parallel/bottleneck.py``). So half 0's all-reduce travels while half 1 runs up to its own
(its norm statistic and A GEMM, then its B GEMMs, attention, ... up to its next all-reduce), and
the other way round: each collective beside the other half's work instead of waiting alone.

The order is fixed: half 0 to its first hand-over, half 1 to its first, half 0 to its second,
and so on; a half that has finished is skipped. State that torch keeps per thread and that a
custom autograd Function changes while its forward runs (grad mode) is saved before a hand-over
and restored after it, so each half sees its own.
"""

from __future__ import annotations

import contextvars
import weakref
from typing import Callable, List, Sequence

import torch
from greenlet import getcurrent as _current, greenlet as _greenlet

from megatron_boost.parallel.residual import gradient_owner

__all__ = ["current_half", "hand_over", "in_half", "join_halves", "run_halves"]


class _HandOver:
    """What a half passes to the scheduler when it hands over (not a result)."""


_HAND_OVER = _HandOver()


def in_half() -> bool:
    """Whether the caller runs inside one half of :func:`run_halves`."""
    return getattr(_current(), "is_half", False)


def current_half():
    """A key of the running half (None outside :func:`run_halves`): what tells the halves'
    own per-call state apart (the op ledger's module scopes)."""
    return _current() if in_half() else None


def hand_over() -> None:
    """Let the other half run up to its next hand-over, then come back (a no-op outside
    :func:`run_halves`). Grad mode is the caller's again on return."""
    if not in_half():
        return
    grad_mode = torch.is_grad_enabled()
    _current().parent.switch(_HAND_OVER)
    torch.set_grad_enabled(grad_mode)


def _half(fn: Callable, argument) -> "_greenlet":
    g = _greenlet(run=lambda: fn(argument))
    g.is_half = True
    g.gr_context = contextvars.copy_context()  # the caller's context variables, per half
    return g


def run_halves(fn: Callable, arguments: Sequence) -> List:
    """``[fn(a) for a in arguments]`` (two of them), the calls interleaved at each
    :func:`hand_over` (module docstring)."""
    grad_mode = torch.is_grad_enabled()
    halves = [_half(fn, a) for a in arguments]
    results: List = [None] * len(halves)
    try:
        while not all(g.dead for g in halves):
            for i, g in enumerate(halves):
                if g.dead:
                    continue
                torch.set_grad_enabled(grad_mode)
                value = g.switch()
                if g.dead:
                    results[i] = value
    finally:
        torch.set_grad_enabled(grad_mode)
        for g in halves:  # after an error in one half: unwind the other (its finally blocks)
            if not g.dead:
                g.throw()
    return results


class _JoinHalves(torch.autograd.Function):
    """fwd: the halves' outputs side by side along the batch, 2 x [s, b/2, d/t] -> [s, b, d/t].
    bwd: each half's rows of the gradient as a contiguous tensor of its own (one copy each),
    recorded with its owner slot as the half's bda's to write into (``parallel/residual.py``).
    torch.cat's backward hands each half a strided view instead, which the B side of fc2 and
    the A side of fc1 then each copy (two copies per half)."""

    @staticmethod
    def forward(ctx, owners, *halves):
        ctx.owners = owners
        return torch.cat(halves, dim=1)

    @staticmethod
    def backward(ctx, grad):
        # a copy always (clone, not contiguous(): a chunk that happens to be contiguous, at
        # s = 1, is the caller's memory, which the A side must not write into)
        halves = [g.clone(memory_format=torch.contiguous_format)
                  for g in grad.chunk(len(ctx.owners), dim=1)]  # [s, b/2, d/t] each
        for owner, g in zip(ctx.owners, halves):
            owner.returned = weakref.ref(g)
        return (None, *halves)


def join_halves(halves: Sequence[torch.Tensor]) -> torch.Tensor:
    """The halves' outputs [s, b/2, d/t] joined into the batch's [s, b, d/t]; in the backward
    each half gets its gradient rows contiguous and writable (:class:`_JoinHalves`)."""
    return _JoinHalves.apply([gradient_owner(h) for h in halves], *halves)
