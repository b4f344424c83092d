"""online-RMSNorm's statistic (docs/design.md §3): the fp32 sum of squares of the local hidden
shard, its all-reduce (recorded and replayed under low-rank recompute), and 1/rms.

boost's column layers fuse the pre-norm into their A GEMM, A·(γ⊙x/rms(x)) = (A·(γ⊙x))/rms(x),
so each rank needs only Σ_k x_k² summed over the TP group. It is fp32 from x to 1/rms in every
dtype. With fp32 products it rides as one extra column of the products' all-reduce; with bf16
products it has an fp32 all-reduce of its own, which :func:`start_sum_of_squares` issues
asynchronously before the A GEMM, so the GEMM runs while it travels.
"""

from __future__ import annotations

from typing import List

import torch

from megatron_boost.parallel.recompute import active_log

__all__ = ["statistic_rides_with_products", "partial_sum_of_squares", "start_sum_of_squares",
           "PendingStatistic", "inverse_rms"]


def statistic_rides_with_products(dtype: torch.dtype) -> bool:
    """Whether the fp32 sum of squares travels as the extra column of the products' all-reduce
    (one Σr + 1 collective): with fp32 products. With bf16 products it is all-reduced in fp32
    on its own, since a bf16 sum of squares carries a 2^-9 relative error that RMSNorm's own
    fp32 statistic does not."""
    return dtype == torch.float32


def _sum_of_squares_grad(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """d(Σ_k x_k²)/dx for the fp32 gradient g [s, b, 1], in x's dtype: 2·x·g."""
    return (g * (2.0 * x.float())).to(x.dtype)


class _SumOfSquares(torch.autograd.Function):
    """Σ_k x_k² over the last dimension, in fp32 ([s, b, 1]), optionally all-reduced.

    fwd: the local sum; with a ``group``, its all-reduce is started asynchronously and the
         handle appended to ``handles`` (the caller waits before reading the result).
    bwd: 2·x·g; the reduction's backward is the identity (the gradient of the reduced
         statistic is the same on every rank, docs/design.md §3).
    Saves x in its own dtype (the fused norm's input, which autograd keeps anyway), not an
    fp32 copy of it."""

    @staticmethod
    def forward(ctx, x, group, handles: List):
        ctx.save_for_backward(x)
        sumsq = x.float().pow(2).sum(dim=-1, keepdim=True)  # [s, b, 1]
        if group is not None:
            handles.append(torch.distributed.all_reduce(sumsq, group=group, async_op=True))
        return sumsq

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return _sum_of_squares_grad(x, g), None, None


def partial_sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """This rank's partial statistic Σ_k x_k² of the local shard x, fp32 [s, b, 1]."""
    return _SumOfSquares.apply(x, None, [])


class PendingStatistic:
    """The all-reduced statistic once :meth:`wait` returns (an all-reduce in flight before).

    In a low-rank checkpointed layer (``parallel/recompute.py``) the complete statistic is
    recorded into the layer's log when waited for, in the forward; in the recompute no
    all-reduce is issued and :meth:`wait` returns the recorded one, with the gradient of the
    local Σx² (docs/design.md §7)."""

    def __init__(self, sumsq: torch.Tensor, handle, log=None):
        self._sumsq, self._handle, self._log = sumsq, handle, log

    def wait(self) -> torch.Tensor:
        """The complete Σx² over the TP group, fp32 [s, b, 1]."""
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
        if self._log is None:
            return self._sumsq
        log, self._log = self._log, None
        if log.replaying:
            self._sumsq = log.replay_next(self._sumsq)
        else:
            log.record(self._sumsq)
        return self._sumsq


def start_sum_of_squares(x: torch.Tensor, group, tp_size: int) -> PendingStatistic:
    """Σx² of the local shard x with its fp32 all-reduce over ``group`` started
    asynchronously (none for one rank, and none in a low-rank recompute): issue it before the
    A GEMM, wait after."""
    log = active_log() if tp_size > 1 else None
    handles: List = []
    reduce_over = None if tp_size == 1 or (log is not None and log.replaying) else group
    sumsq = _SumOfSquares.apply(x, reduce_over, handles)
    return PendingStatistic(sumsq, handles[0] if handles else None, log)


def inverse_rms(sumsq: torch.Tensor, hidden_size: int, eps: float) -> torch.Tensor:
    """1/rms = rsqrt(Σx²/d + ε), fp32 [s, b, 1], from the complete statistic."""
    return torch.rsqrt(sumsq / hidden_size + eps)
