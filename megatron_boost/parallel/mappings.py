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

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import torch
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron.core.utils import get_pg_size

from megatron_boost.parallel.online_rmsnorm import (bottleneck_input, bottleneck_input_backward,
                                                   statistic_rides_with_products,
                                                   sum_of_squares)
from megatron_boost.parallel.recompute import active_log
from megatron_boost.parallel.wgrad import accumulation_target, dummy_gradient, gemm_into

__all__ = [
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "reduce_forward",
    "reduce_products",
    "reduce_scatter_to_hidden_shards",
    "split_project",
    "BottleneckActivation",
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


def _gemm_all_reduce(x2d: torch.Tensor, w: torch.Tensor, out2d: torch.Tensor, group) -> None:
    """out2d[:, :n] = x2d · Wᵀ, then out2d all-reduced over ``group`` in place (the GEMM writes
    straight into the buffer the all-reduce reduces)."""
    torch.mm(x2d, w.t(), out=out2d[:, :w.shape[0]])
    if get_pg_size(group) > 1:
        torch.distributed.all_reduce(out2d, group=group)


class _ProductsAllReduceFwdGemmBwd(torch.autograd.Function):
    """boost's A side: P = Σ_ranks x_k · W_kᵀ, and with the fused norm the fp32 statistic
    Σ_ranks Σ x_k² (docs/design.md §3).

    fwd: the statistic's region; with fp32 products it rides as the last column of the
         products' all-reduce (Σr + 1), with bf16 ones its own fp32 all-reduce is started
         before the GEMM and waited for after it. The GEMM writes straight into the buffer the
         all-reduce reduces in place (blocks of sequence positions pipelined with σ and the B
         GEMMs: ``parallel/pipeline.py``). In a low-rank recompute: the recorded results, no GEMM,
         no collective.
    bwd: no communication (the reduction's backward is the identity): dx = dP·W (+ 2·x·dΣx²,
         one kernel), dW = dPᵀ·x.
    Returns P [s, b, Σr] (a view of the reduced buffer) and, with the statistic, Σx² [s, b, 1].
    """

    @staticmethod
    def forward(ctx, x, w, group, with_statistic: bool, fuse_wgrad: bool):
        ctx.with_statistic = with_statistic
        ctx.save_for_backward(x, w)
        # dW into W's main_grad (parallel/wgrad.py); the γ-scaled A has none (its fold does it)
        ctx.main_grad = accumulation_target(w, fuse_wgrad, x.dtype)
        log = active_log() if get_pg_size(group) > 1 else None
        if log is not None and log.replaying:
            return _replayed_products(log, w.shape[0], x.dtype, with_statistic)
        n, rides = w.shape[0], statistic_rides_with_products(x.dtype)
        *lead, width = x.shape
        x2d = x.reshape(-1, width)  # [s·b, d_in/t]
        sumsq = sum_of_squares(x) if with_statistic else None  # fp32 [s, b, 1]
        handle = None
        if with_statistic and not rides and get_pg_size(group) > 1:
            handle = torch.distributed.all_reduce(sumsq, group=group, async_op=True)
        out = x.new_empty(*lead, n + (1 if with_statistic and rides else 0))  # [s, b, Σr (+1)]
        out2d = out.view(-1, out.shape[-1])
        if with_statistic and rides:
            out[..., n:].copy_(sumsq)  # one value per token: the column rides along
        _gemm_all_reduce(x2d, w, out2d, group)
        if handle is not None:
            handle.wait()
        if with_statistic and rides:
            sumsq = out[..., n:]
        if log is not None:  # in issue order; one fused tensor when the column rides
            log.record(out)
            if with_statistic and not rides:
                log.record(sumsq)
        products = out[..., :n] if out.shape[-1] != n else out
        return (products, sumsq) if with_statistic else products

    @staticmethod
    def backward(ctx, d_products, d_sumsq=None):
        x, w = ctx.saved_tensors
        g2d = d_products.reshape(-1, w.shape[0])  # [s·b, Σr]
        dx = torch.mm(g2d, w).view(x.shape)  # [s, b, d_in/t]
        if ctx.with_statistic and d_sumsq is not None:
            dx.addcmul_(x, d_sumsq, value=2.0)  # + d(Σx²)/dx, in the same buffer
        x2d = x.reshape(-1, x.shape[-1])
        if ctx.main_grad is not None:  # [Σr, d_in/t], accumulated in the GEMM
            gemm_into(ctx.main_grad, g2d.t(), x2d, accumulate=True)
            return dx, dummy_gradient(w), None, None, None
        return dx, torch.mm(g2d.t(), x2d), None, None, None  # dW [Σr, d_in/t]


def _replayed_products(log, n: int, dtype, with_statistic: bool):
    """The recorded reductions of a low-rank recompute, as the forward returned them."""
    first = log.next_recorded()
    if not with_statistic:
        return first.view_as(first)
    if statistic_rides_with_products(dtype):
        return first[..., :n], first[..., n:]
    return first.view_as(first), log.next_recorded().view_as(first[..., :1])


def reduce_products(x: torch.Tensor, w: torch.Tensor, group, with_statistic: bool = False,
                    fuse_wgrad: bool = False):
    """boost's A side: ONE GEMM of the group's (γ-scaled) A factors on the local shard x
    [s, b, d_in/t] and ONE all-reduce of the partial products (Σr wide; with the statistic
    Σr + 1, or Σr and an fp32 1 in bf16). ``fuse_wgrad``: dW accumulates in W's main_grad
    (``parallel/wgrad.py``).
    Returns P [s, b, Σr], or (P, Σx² [s, b, 1]) ``with_statistic``
    (:class:`_ProductsAllReduceFwdGemmBwd`)."""
    return _ProductsAllReduceFwdGemmBwd.apply(x, w, group, with_statistic, fuse_wgrad)


def split_project(z: torch.Tensor, weights, ranks: Sequence[int]) -> List[torch.Tensor]:
    """y_p = z_p · W_p^T for each projection p; z: [s, b, Σr] split by ``ranks``.
    Local GEMMs only, no communication."""
    return [torch.matmul(zp, w.t()) for zp, w in zip(z.split(list(ranks), dim=-1), weights)]


@dataclass(frozen=True)
class BottleneckActivation:
    """What lies between a group's reduced products and its B factors: the fused norm's scale
    (with the statistic) and σ (``parallel/online_rmsnorm.py``)."""

    act: Callable
    act_grad: Callable
    identity: bool
    hidden_size: int
    eps: float

    def forward(self, products, sumsq):
        return bottleneck_input(products, sumsq, self.hidden_size, self.eps, self.act,
                                self.identity)

    def backward(self, products, sumsq, dz):
        return bottleneck_input_backward(products, sumsq, dz, self.hidden_size, self.eps,
                                         self.act_grad, self.identity)


def _up_project(z: torch.Tensor, b: torch.Tensor, rows: Sequence[int], ranks: Sequence[int],
                batched: bool) -> List[torch.Tensor]:
    """y_p = z_p · B_pᵀ for each projection p, z [s, b, Σr] = [z_1 | z_2 | ...], B the grouped
    factor [Σ out_p, r] (rows ``rows``): with ``batched`` and equal shapes, one batched GEMM
    whose outputs share one buffer, else one GEMM per projection on its row view."""
    if batched and len(rows) > 1 and len(set(rows)) == 1 and len(set(ranks)) == 1:
        g, r, out = len(rows), ranks[0], rows[0]
        zb = z.reshape(-1, g, r).transpose(0, 1)  # [G, s·b, r], strided: no copy
        y = torch.bmm(zb, b.view(g, out, r).transpose(1, 2))  # [G, s·b, out]
        return [y[i].view(*z.shape[:-1], out) for i in range(g)]  # [s, b, out] each
    return split_project(z, b.split(list(rows), dim=0), ranks)


def _input_gradient(grads, b: torch.Tensor, rows: Sequence[int], ranks: Sequence[int],
                    like: torch.Tensor) -> torch.Tensor:
    """dz = [g_1·B_1 | g_2·B_2 | ...] [s, b, Σr]: each projection's GEMM writes its columns of
    one buffer (no concatenation)."""
    if len(rows) == 1:
        return torch.mm(grads[0], b).view(*like.shape[:-1], b.shape[-1])
    dz = like.new_empty(*like.shape[:-1], sum(ranks))
    dz2d, first = dz.view(-1, dz.shape[-1]), 0
    for g2d, w, r in zip(grads, b.split(list(rows), dim=0), ranks):
        torch.mm(g2d, w, out=dz2d[:, first:first + r])
        first += r
    return dz


def _weight_gradient(grads, z: torch.Tensor, b: torch.Tensor, rows: Sequence[int],
                     ranks: Sequence[int], main_grad: Optional[torch.Tensor]) -> torch.Tensor:
    """dB = [g_1ᵀ·z_1; g_2ᵀ·z_2; ...] [Σ out_p, r]: each projection's GEMM writes its rows of
    the grouped factor's gradient, or adds them to B's ``main_grad`` (then the returned
    gradient is the dummy of ``parallel/wgrad.py``)."""
    z2d = z.view(-1, z.shape[-1])
    if len(rows) == 1 and main_grad is None:
        return torch.mm(grads[0].t(), z2d)
    db, first_row, first_col = main_grad if main_grad is not None else torch.empty_like(b), 0, 0
    for g2d, n, r in zip(grads, rows, ranks):
        gemm_into(db[first_row:first_row + n], g2d.t(), z2d[:, first_col:first_col + r],
                  accumulate=main_grad is not None)
        first_row, first_col = first_row + n, first_col + r
    return db if main_grad is None else dummy_gradient(b)


class _UpProjectAllReduceDgrad(torch.autograd.Function):
    """boost: z = σ(scale(P)) and y_p = z_p · B_pᵀ for each projection p of a group,
    z = [z_1 | z_2 | ...], B the grouped factor [Σ out_p/t, r].

    fwd: the norm's scale and σ in one region, then the B GEMMs (one batched GEMM with
         ``batched`` and equal shapes); no communication. Keeps P and the statistic (for σ' and the
         scale's gradient, recomputed in the backward region) and z (bf16: the dB GEMMs').
    bwd: dz (width Σr, partial: each rank holds out/t rows of B) is all-reduced ASYNCHRONOUSLY
         while the weight gradients dB_p = g_pᵀ z_p are computed, then waited on (the same
         collective as copy_to_tensor_model_parallel_region, overlapped with compute;
         ``overlap`` False completes it first); then dP (and dΣx²) in one region.
    """

    @staticmethod
    def forward(ctx, products, sumsq, b, group, rows, ranks, activation, overlap, batched,
                fuse_wgrad):
        ctx.group, ctx.rows, ctx.ranks = group, rows, ranks
        ctx.main_grad = accumulation_target(b, fuse_wgrad, products.dtype)
        ctx.activation, ctx.overlap = activation, overlap
        z = activation.forward(products, sumsq)  # [s, b, Σr]
        ctx.save_for_backward(products, sumsq, z, b)
        return tuple(_up_project(z, b, rows, ranks, batched))

    @staticmethod
    def backward(ctx, *grads):
        products, sumsq, z, b = ctx.saved_tensors
        # [s·b, out_p/t] each; an unused output gets no gradient: treat it as zero
        grads = [g.reshape(-1, g.shape[-1]) if g is not None
                 else z.new_zeros(z.numel() // z.shape[-1], n) for g, n in zip(grads, ctx.rows)]
        dz = _input_gradient(grads, b, ctx.rows, ctx.ranks, z)  # [s, b, Σr], partial
        handle = None
        if get_pg_size(ctx.group) > 1:
            handle = torch.distributed.all_reduce(dz, group=ctx.group, async_op=ctx.overlap)
        db = _weight_gradient(grads, z, b, ctx.rows, ctx.ranks, ctx.main_grad)  # [Σ out_p/t, r]
        if handle is not None and ctx.overlap:
            handle.wait()
        d_products, d_sumsq = ctx.activation.backward(products, sumsq, dz)
        return d_products, d_sumsq, db, None, None, None, None, None, None, None


def bottleneck_up(products: torch.Tensor, sumsq: Optional[torch.Tensor], b: torch.Tensor,
                  rows: Sequence[int], ranks: Sequence[int], group,
                  activation: BottleneckActivation, overlap: bool = True,
                  batched: bool = False, fuse_wgrad: bool = False) -> List[torch.Tensor]:
    """boost's B side on the reduced products P [s, b, Σr] (and the statistic, with the fused
    norm): [s, b, out_p/t] per projection, from the grouped B factor [Σ out_p/t, r].
    fwd: no communication; bwd: all-reduce of dz (Σr), overlapped with the dB GEMMs when
    ``overlap`` (:class:`_UpProjectAllReduceDgrad`). ``batched``: one batched GEMM for
    projections of equal shapes, whose outputs then share one buffer (worth it only when the
    consumer keeps every output alive: a buffer lives as long as any view of it).
    ``fuse_wgrad``: dB accumulates in B's main_grad (``parallel/wgrad.py``)."""
    return list(_UpProjectAllReduceDgrad.apply(products, sumsq, b, group, list(rows),
                                               list(ranks), activation, overlap, batched,
                                               fuse_wgrad))


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
