"""Low-rank activation checkpointing of a decoder layer (docs/design.md §7; BOOST, arXiv
2512.12131, "low-rank activation checkpointing").

A checkpointed layer keeps, for its backward, only its input (boost: the hidden shard
[s, b, d/t]) and the results of its forward all-reduces (boost: the Σr (+1) wide bottleneck
sums and online-RMSNorm's fp32 sums of squares, whose stand-in lives with the norm in
``model/online_rmsnorm.py``; naive: the reduced chunk outputs). The
backward re-runs the layer; each forward all-reduce is then served from the recorded result,
so a recompute never re-runs a collective and computes bitwise the same values.

The state is explicit: a :class:`ForwardReductions` object is installed on the layer's
bottleneck groups (their ``forward_reductions`` attribute) for the duration of the forward and
of the recompute only (:func:`installed`), and records, then replays, their reductions in issue
order. Outside a checkpointed layer the attribute is None and the groups reduce normally.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, List, Optional

import torch

__all__ = ["ForwardReductions", "installed", "lowrank_checkpoint", "replay_product"]


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


class _ReplayProduct(torch.autograd.Function):
    """Recompute stand-in of all-reduce(xin · A^T) (boost's A side): the recorded result is
    returned and the partial product is NOT recomputed, since its gradient does not need it.

    fwd: no communication, no GEMM (the recorded, already reduced [s, b, Σr]).
    bwd: what the product and the reduction would give: dxin = g · A, dA = (xin^T · g)^T (the
         same GEMMs, in the same form, as autograd's matmul backward). No communication (the
         reduction's bwd is identity).
    """

    @staticmethod
    def forward(ctx, xin, a, recorded):
        ctx.save_for_backward(xin, a)
        return recorded.clone()

    @staticmethod
    def backward(ctx, g):
        xin, a = ctx.saved_tensors
        g2d = g.reshape(-1, a.shape[0])  # [s·b, Σr]
        xin2d = xin.reshape(-1, xin.shape[-1])  # [s·b, d_in/t]
        dxin = g2d.mm(a).view(xin.shape)  # [s, b, d_in/t]
        da = xin2d.t().mm(g2d).t()  # [Σr, d_in/t]
        return dxin, da, None


def replay_product(xin: torch.Tensor, a: torch.Tensor, recorded: torch.Tensor) -> torch.Tensor:
    """The recorded all-reduce(xin · A^T), with that expression's gradients
    (:class:`_ReplayProduct`): no communication, no GEMM."""
    return _ReplayProduct.apply(xin, a, recorded)


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
            return _ReplayReduce.apply(x, self.next_recorded())
        out = all_reduce(x)
        self.results.append(out.detach())
        return out

    def record(self, reduced: torch.Tensor) -> None:
        """Record the result of a reduction issued outside :meth:`reduce` (an asynchronous
        one, once it is complete); only while recording."""
        self.results.append(reduced.detach())

    def check_consumed(self) -> None:
        """A recompute must replay exactly the reductions its forward recorded."""
        if self._next != len(self.results):
            raise RuntimeError(f"low-rank recompute replayed {self._next} of "
                               f"{len(self.results)} recorded forward reductions")


@contextlib.contextmanager
def installed(modules: List[torch.nn.Module], reductions: ForwardReductions):
    """Set ``forward_reductions`` on ``modules`` for the block; None again afterwards."""
    for m in modules:
        m.forward_reductions = reductions
    try:
        yield reductions
    finally:
        for m in modules:
            m.forward_reductions = None


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
    def forward(ctx, run_fn, modules, hidden):
        ctx.run_fn, ctx.modules = run_fn, modules
        ctx.rng = _rng_states()
        # The autograd engine runs backward with an empty torch-function-mode stack; the
        # recompute must see the same modes as the forward (CPU mode is one, docs/design.md §9).
        ctx.modes = torch.overrides._get_current_function_mode_stack()
        with torch.no_grad(), installed(modules, ForwardReductions()) as record:
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
            with torch.enable_grad(), installed(ctx.modules, replay):
                out = ctx.run_fn(hidden)
            replay.check_consumed()
        _set_rng_states(rng)
        torch.autograd.backward(out, grad)
        return None, None, hidden.grad


def lowrank_checkpoint(run_fn: Callable[[torch.Tensor], torch.Tensor],
                       modules: List[torch.nn.Module], hidden: torch.Tensor) -> torch.Tensor:
    """``run_fn(hidden)`` checkpointed: only ``hidden`` and the forward reductions of
    ``modules`` (the layer's bottleneck groups) are kept for the backward."""
    return _LowRankCheckpoint.apply(run_fn, modules, hidden)
