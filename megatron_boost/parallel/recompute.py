"""Low-rank activation checkpointing of a decoder layer (docs/design.md §7; BOOST, arXiv
2512.12131, "low-rank activation checkpointing").

A checkpointed layer keeps, for its backward, only its input (boost: the hidden shard
[s, b, d/t]) and the results of its forward all-reduces (boost: the Σr (+1) wide bottleneck
sums and online-RMSNorm's fp32 sums of squares; naive: the reduced chunk outputs). The
backward re-runs the layer; each forward all-reduce is then served from the recorded result,
so a recompute never re-runs a collective and computes bitwise the same values.

The layers do not know about it: their forward is written once. The log of the layer's forward
reductions (:class:`ForwardReductions`) is the context of the collectives themselves
(:func:`active_log`), set by :func:`lowrank_checkpoint` for the checkpointed forward and for the
recompute only. The forward all-reduces (``reduce_forward`` in ``parallel/mappings.py``,
``down_project`` in ``parallel/bottleneck.py``) and online-RMSNorm's statistic
(``parallel/online_rmsnorm.py``) record their results into it, then replay them in issue order
(boost's A side, ``down_project``, then skips its GEMM too: its backward needs only the input and the factor). Outside a checkpointed layer there is no log
and they reduce normally.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterable, List, Optional

import torch

__all__ = ["ForwardReductions", "active_log", "lowrank_checkpoint", "replay_reduce"]


class _ReplayReduce(torch.autograd.Function):
    """Recompute stand-in of a forward all-reduce: returns the result recorded in the first
    forward pass.

    fwd: no communication (the recorded, already reduced tensor).
    bwd: identity, exactly as the reduction it replaces (fwd all-reduce, bwd identity).
    """

    @staticmethod
    def forward(ctx, x, recorded):
        return recorded.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def replay_reduce(partial: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """The recorded all-reduce(partial): no communication; its backward hands the gradient to
    ``partial`` unchanged, as the reduction's (:class:`_ReplayReduce`)."""
    return _ReplayReduce.apply(partial, recorded)


class ForwardReductions:
    """The results of one layer's forward all-reduces, in issue order.

    Built empty, it records (the checkpointed forward); built from recorded results, it
    replays them, in the same order, without communicating (the recompute).
    """

    def __init__(self, recorded: Optional[Iterable[torch.Tensor]] = None):
        self.replaying = recorded is not None
        self.results: List[torch.Tensor] = list(recorded) if self.replaying else []
        self._next = 0

    def next_recorded(self) -> torch.Tensor:
        """The next recorded result, in issue order; only while replaying."""
        out = self.results[self._next]
        self._next += 1
        return out

    def reduce(self, x: torch.Tensor, all_reduce: Callable) -> torch.Tensor:
        """``all_reduce(x)``, recorded; when replaying, the recorded result instead."""
        if self.replaying:
            return self.replay_next(x)
        out = all_reduce(x)
        self.results.append(out.detach())
        return out

    def replay_next(self, partial: torch.Tensor) -> torch.Tensor:
        """The next recorded result in the place of ``all_reduce(partial)``
        (:func:`replay_reduce`); only while replaying."""
        return replay_reduce(partial, self.next_recorded())

    def record(self, reduced: torch.Tensor) -> None:
        """Record the result of a reduction issued outside :meth:`reduce` (an asynchronous
        one, once it is complete); only while recording."""
        self.results.append(reduced.detach())

    def check_consumed(self) -> None:
        """A recompute must replay exactly the reductions its forward recorded."""
        if self._next != len(self.results):
            raise RuntimeError(f"low-rank recompute replayed {self._next} of "
                               f"{len(self.results)} recorded forward reductions")


_ACTIVE: contextvars.ContextVar[Optional[ForwardReductions]] = contextvars.ContextVar(
    "lowrank_forward_reductions", default=None)


def active_log() -> Optional[ForwardReductions]:
    """The log of the checkpointed layer now running (its forward or its recompute), or None
    outside low-rank checkpointing."""
    return _ACTIVE.get()


@contextlib.contextmanager
def _logging(reductions: ForwardReductions):
    """Make ``reductions`` the active log for the block; the previous one afterwards."""
    token = _ACTIVE.set(reductions)
    try:
        yield reductions
    finally:
        _ACTIVE.reset(token)


def _rng_states():
    """The CPU and CUDA generator states and megatron's RNG tracker states (the tensor-parallel
    dropout streams), the three that megatron's own checkpoint function saves."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    return torch.get_rng_state(), cuda, get_cuda_rng_tracker().get_states()


def _set_rng_states(states) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    cpu, cuda, tracker = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda)
    get_cuda_rng_tracker().set_states(tracker)


class _LowRankCheckpoint(torch.autograd.Function):
    """Low-rank activation checkpointing of one decoder layer.

    fwd: runs the layer without building a graph, recording the results of its forward
         all-reduces; saves only the layer input and those results.
    bwd: re-runs the layer with the recorded reductions replayed (no collective is re-run),
         then back-propagates through it; the backward collectives are the usual ones.
    """

    @staticmethod
    def forward(ctx, run_fn, hidden):
        ctx.run_fn = run_fn
        ctx.rng = _rng_states()
        # The autograd engine runs backward with an empty torch-function-mode stack; the
        # recompute must see the same modes as the forward (CPU mode is one, docs/design.md §9).
        ctx.modes = torch.overrides._get_current_function_mode_stack()
        with torch.no_grad(), _logging(ForwardReductions()) as record:
            out = run_fn(hidden)
        ctx.save_for_backward(hidden, *record.results)
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, *recorded = ctx.saved_tensors
        hidden = hidden.detach().requires_grad_(hidden.requires_grad)
        rng = _rng_states()
        _set_rng_states(ctx.rng)  # the recompute draws the forward's dropout masks
        with contextlib.ExitStack() as modes:
            for mode in ctx.modes:
                modes.enter_context(mode)
            replay = ForwardReductions(recorded)
            with torch.enable_grad(), _logging(replay):
                out = ctx.run_fn(hidden)
            replay.check_consumed()
        _set_rng_states(rng)
        torch.autograd.backward(out, grad)
        return None, hidden.grad


def lowrank_checkpoint(run_fn: Callable[[torch.Tensor], torch.Tensor],
                       hidden: torch.Tensor) -> torch.Tensor:
    """``run_fn(hidden)`` checkpointed: only ``hidden`` and the results of the forward
    all-reduces that run_fn issues through the logged collectives are kept for the
    backward."""
    return _LowRankCheckpoint.apply(run_fn, hidden)
