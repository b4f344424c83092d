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

All of them return early for a group of one rank. BOOST's own collectives are
:func:`bottleneck_up`: the B factors on the replicated bottleneck, whose backward all-reduce of
dz overlaps the dB GEMMs (docs/design.md §7), and :func:`reduce_scatter_to_hidden_shards`
(fwd reduce-scatter along the last dimension, bwd all-gather along it): the tied embedding's
partial rows [b, s, d] become the hidden shards [b, s, d/t] (docs/design.md §2). megatron's
``reduce_scatter_last_dim_to_tensor_parallel_region`` has that contract, but its backward
allocates on ``torch.cuda.current_device()``, which CPU mode cannot redirect inside autograd;
these allocate beside their input. Each is one autograd Function in the manner of megatron's.

The layers' forward all-reduces go through :func:`reduce_forward` (megatron's
``reduce_from_tensor_model_parallel_region``) and :func:`reduce_products` (boost's A side):
under low-rank activation checkpointing they record into, then replay from, the checkpointed
layer's log (``parallel/recompute.py``), so the layers' forward is written once.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.utils import get_pg_size

from megatron_boost.parallel.recompute import active_log, replay_product, replay_reduce

__all__ = [
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_forward",
    "reduce_products",
    "reduce_scatter_to_hidden_shards",
    "split_project",
    "bottleneck_up",
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


def reduce_products(xin: torch.Tensor, a: torch.Tensor, group,
                    extra: Optional[torch.Tensor] = None
                    ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """boost's A side: ONE GEMM of the group's A factors and ONE all-reduce of the partial
    products, xin [s, b, d_in/t] · A^T -> [s, b, Σr]; ``extra`` partial columns [s, b, k] (the
    fused norm's fp32 statistic) ride as the last columns of the same all-reduce. fwd AR(Σr
    (+k)), bwd identity (then the GEMM's backward). Returns (products, reduced extra or None).

    In the recompute of a low-rank checkpointed layer the recorded sums are returned without
    communicating and without the product's GEMM (its gradient needs only xin and A)."""
    log = active_log()
    if log is not None and log.replaying and get_pg_size(group) > 1:
        recorded = log.next_recorded()
        n = a.shape[0]
        products = replay_product(xin, a, recorded[..., :n])  # [s, b, Σr]
        if extra is None:
            return products, None
        return products, replay_reduce(extra, recorded[..., n:])  # [s, b, k]
    partial = torch.matmul(xin, a.t())  # [s, b, Σr]
    if extra is None:
        return reduce_forward(partial, group), None
    fused = reduce_forward(torch.cat([partial, extra], dim=-1), group)  # [s, b, Σr + k]
    products, reduced = fused.split([partial.shape[-1], extra.shape[-1]], dim=-1)
    return products, reduced


def split_project(z: torch.Tensor, weights, ranks: Sequence[int]) -> List[torch.Tensor]:
    """y_p = z_p · W_p^T for each projection p; z: [s, b, Σr] split by ``ranks``.
    Local GEMMs only, no communication."""
    return [torch.matmul(zp, w.t()) for zp, w in zip(z.split(list(ranks), dim=-1), weights)]


class _UpProjectAllReduceDgrad(torch.autograd.Function):
    """boost: y_p = z_p · B_p^T for each projection p of a group, z = [z_1 | z_2 | ...].

    fwd: identity on z (replicated) and the local GEMMs; no communication.
    bwd: dz (width Σr, partial: each rank holds out/t rows of B) is all-reduced ASYNCHRONOUSLY
         while the weight gradients dB_p = g_p^T z_p are computed, then waited on. The same
         collective as copy_to_tensor_model_parallel_region, overlapped with compute.
    """

    @staticmethod
    def forward(ctx, z, group, ranks, *weights):
        ctx.group, ctx.ranks = group, ranks
        ctx.save_for_backward(z, *weights)
        return tuple(split_project(z, weights, ranks))

    @staticmethod
    def backward(ctx, *grads):
        z, *weights = ctx.saved_tensors
        # An unused output gets no gradient: treat it as zero.
        grads = [g if g is not None else z.new_zeros(*z.shape[:-1], w.shape[0])
                 for g, w in zip(grads, weights)]
        dz = torch.cat([torch.matmul(g, w) for g, w in zip(grads, weights)], dim=-1)  # [s,b,Σr]
        handle = None
        if get_pg_size(ctx.group) > 1:
            dz = dz.contiguous()
            handle = torch.distributed.all_reduce(dz, group=ctx.group, async_op=True)
        zs = z.split(ctx.ranks, dim=-1)
        dws = [torch.matmul(g.reshape(-1, g.shape[-1]).t(), zp.reshape(-1, zp.shape[-1]))
               for g, zp in zip(grads, zs)]  # [out_p/t, r_p] each, from [s·b, ·] operands
        if handle is not None:
            handle.wait()
        return (dz, None, None, *dws)


def bottleneck_up(z: torch.Tensor, weights, ranks: Sequence[int], group,
                  overlap: bool = True) -> List[torch.Tensor]:
    """boost's B factors of a group on the replicated bottleneck z: [s, b, Σr] ->
    [s, b, out_p/t] per projection.

    fwd: no communication; bwd: all-reduce of dz (Σr), overlapped with the dB GEMMs when
    ``overlap`` (see _UpProjectAllReduceDgrad), else issued first
    (copy_to_tensor_model_parallel_region) as in the plain autograd graph."""
    if not overlap:
        return split_project(copy_to_tensor_model_parallel_region(z, group=group), weights,
                             ranks)
    return list(_UpProjectAllReduceDgrad.apply(z, group, list(ranks), *weights))


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
