"""The tensor-parallel collectives of megatron-boost (docs/design.md §2, §5).

megatron-core's ``tensor_parallel`` already has every collective the modes need but one; they
are re-exported here under their megatron names, and the layers call them by those names:

* ``reduce_from_tensor_model_parallel_region`` — fwd all-reduce, bwd identity. boost: the
  rank-partial bottleneck products [s, b, Σr (+1)] (with online-RMSNorm's partial sums of
  squares, docs/design.md §3); naive: the row-parallel chunk output [s, b, Σ d_out].
* ``copy_to_tensor_model_parallel_region`` — fwd identity, bwd all-reduce. boost: the replicated
  bottleneck activation handed to the rank-local B factors (when the overlap is off); naive:
  the replicated input of the column-parallel A factors (when the overlap is off).
* ``gather_from_tensor_model_parallel_region`` — fwd all-gather along the last dimension
  ([s, b, d/t] -> [s, b, d], boost's final norm), bwd local slice.
* ``linear_with_grad_accumulation_and_async_allreduce(..., allreduce_dgrad=True)`` — naive's
  column-parallel A: fwd GEMM, bwd all-reduce of dx overlapped with the dA GEMM. Its keywords
  differ between megatron-core versions, so it is called through
  :func:`megatron_boost.compat.linear_with_dgrad_allreduce`.

All of them return early for a group of one rank. BOOST's own collective is
:func:`reduce_scatter_to_hidden_shards` (:class:`_ReduceScatterLastDimFwdAllGatherBwd`: fwd
reduce-scatter along the last dimension, bwd all-gather along it): the tied embedding's partial
rows [b, s, d] become the hidden shards [b, s, d/t] (docs/design.md §2). megatron's
``reduce_scatter_last_dim_to_tensor_parallel_region`` has that contract, but its backward
allocates on ``torch.cuda.current_device()``, which CPU mode cannot redirect inside autograd;
this one allocates beside its input.

The naive layers' forward all-reduce goes through :func:`reduce_forward` (megatron's
``reduce_from_tensor_model_parallel_region``): under low-rank activation checkpointing it records
into, then replays from, the checkpointed layer's log (``parallel/recompute.py``), so the layers'
forward is written once. The GEMMs fused with a collective (boost's A and B sides) are in
``parallel/bottleneck.py``.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.utils import get_pg_size

from megatron_boost.parallel.recompute import active_log

__all__ = [
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_forward",
    "reduce_scatter_to_hidden_shards",
]


def reduce_forward(x: torch.Tensor, group) -> torch.Tensor:
    """fwd all-reduce of x over ``group``, bwd identity (megatron's
    reduce_from_tensor_model_parallel_region). In a low-rank checkpointed layer the result is
    recorded in the forward and replayed, without communicating, in the recompute
    (docs/design.md §7)."""
    if get_pg_size(group) == 1:
        return x

    def all_reduce(t):
        return reduce_from_tensor_model_parallel_region(t, group=group)

    log = active_log()
    return all_reduce(x) if log is None else log.reduce(x, all_reduce)


class _ReduceScatterLastDimFwdAllGatherBwd(torch.autograd.Function):
    """fwd: reduce-scatter along the last dimension, [..., d] (partial) -> [..., d/t] (summed,
    this rank's slice); bwd: all-gather of the gradient along it, [..., d/t] -> [..., d]."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        t = get_pg_size(group)
        *lead, d = x.shape
        # [t·n, d/t], rank i's slice in rows [i·n, (i+1)·n) (n tokens): the layout every
        # backend's reduce_scatter_tensor takes (gloo: along dim 0 only)
        slices = torch.cat(x.reshape(-1, d).chunk(t, dim=-1))
        out = x.new_empty(slices.shape[0] // t, d // t)  # [n, d/t]
        torch.distributed.reduce_scatter_tensor(out, slices, group=group)
        return out.view(*lead, d // t)  # [..., d/t]

    @staticmethod
    def backward(ctx, grad):
        t = get_pg_size(ctx.group)
        *lead, d_t = grad.shape
        grad = grad.reshape(-1, d_t).contiguous()  # [n, d/t]
        gathered = grad.new_empty(t * grad.shape[0], d_t)  # [t·n, d/t], rank i's at i·n
        torch.distributed.all_gather_into_tensor(gathered, grad, group=ctx.group)
        return torch.cat(gathered.chunk(t), dim=-1).view(*lead, t * d_t), None  # [..., d]


def reduce_scatter_to_hidden_shards(x: torch.Tensor, group) -> torch.Tensor:
    """[..., d] partial sums on every rank -> this rank's hidden shard [..., d/t] of their sum
    (bwd: all-gather). Identity for a group of one rank."""
    if get_pg_size(group) == 1:
        return x
    return _ReduceScatterLastDimFwdAllGatherBwd.apply(x, group)
