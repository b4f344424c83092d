"""boost's bottleneck: the GEMMs of a projection group fused with its collectives
(docs/design.md §2, §3, §4, §7).

A boost group computes y_p = B_p·σ(P_p) with P = Σ_ranks x_k·A_kᵀ: only the r-wide bottleneck
crosses ranks. The two sides are named after the direction they project in:

* :func:`down_project` (d_in/t -> r, the A side, :class:`_DownProjectAllReduceFwd`): ONE GEMM of
  the group's (γ-scaled) A factors on the local shard, ONE all-reduce of the partial products
  (with the fused norm's statistic riding along); backward: GEMMs only.
* :func:`up_project` (r -> d_out/t, the B side, :class:`_UpProjectAllReduceBwd`): the norm's
  scale and σ (:class:`BottleneckActivation`), then the B GEMMs; backward: the all-reduce of dz,
  overlapped with the dB GEMMs.
* :func:`split_project`: one GEMM per projection on its columns of z, no communication.

Everything a group's B side needs besides its tensors travels in one
:class:`BottleneckGeometry`. The collectives proper (megatron's and boost's own) are in
``parallel/mappings.py``; the pipelined variant of a whole group in ``parallel/pipeline.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from megatron.core.utils import get_pg_size

from megatron_boost.parallel.interleave import hand_over, in_half
from megatron_boost.parallel.online_rmsnorm import (bottleneck_input, bottleneck_input_backward,
                                                   statistic_rides_with_products,
                                                   sum_of_squares)
from megatron_boost.parallel.recompute import active_log
from megatron_boost.parallel.residual import residual_slot_of, take_residual_gradient
from megatron_boost.parallel.wgrad import accumulation_target, dummy_gradient, gemm_into

__all__ = ["BottleneckActivation", "BottleneckGeometry", "GradientLink", "down_project",
           "up_project", "split_project"]


class GradientLink:
    """A group's B side and A side in the backward of an interleaved half
    (``parallel/interleave.py``): the B side starts the all-reduce of dP (and dΣx²) and leaves
    it running; the A side waits for it before its GEMMs read dP. Between the two, autograd runs
    the other half's nodes, which were created in between (docs/design.md §7)."""

    def __init__(self):
        self.handles: List = []

    def wait(self) -> None:
        for handle in self.handles:
            handle.wait()
        self.handles = []


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


@dataclass(frozen=True)
class BottleneckGeometry:
    """A boost group's B side besides its tensors."""

    group: object
    """The TP group dz is all-reduced over."""
    rows: Tuple[int, ...]
    """Local rows of each projection's B factor (its local output width out_p/t)."""
    ranks: Tuple[int, ...]
    """Each projection's rank: its columns of P and z."""
    activation: BottleneckActivation
    """The norm's scale and σ between the products and the B GEMMs."""
    overlap: bool = True
    """``overlap_bottleneck_grad_reduce``: dz's all-reduce runs beside the dB GEMMs."""
    batched: bool = False
    """One batched GEMM for projections of equal shapes, whose outputs then share one buffer
    (worth it only when the consumer keeps every output alive)."""
    fuse_wgrad: bool = False
    """dB accumulates in B's main_grad (``parallel/wgrad.py``)."""

    def equal_shapes(self) -> bool:
        """Several projections of one output width and one rank (one batched GEMM can run
        them)."""
        return len(self.rows) > 1 and len(set(self.rows)) == 1 and len(set(self.ranks)) == 1


# -- the A side: d_in/t -> r --------------------------------------------------------------------


def _down_project_buffer(x: torch.Tensor, n: int, group, with_statistic: bool):
    """The buffer the products are reduced in, [s, b, Σr (+1)], the fp32 statistic Σx²
    [s, b, 1] (None without the fused norm) and the handle of the statistic's own all-reduce.
    With fp32 products the statistic rides as the buffer's last column (one value per token);
    with bf16 ones its fp32 all-reduce is started here, before the GEMM."""
    if not with_statistic:
        return x.new_empty(*x.shape[:-1], n), None, None
    sumsq = sum_of_squares(x)  # fp32 [s, b, 1]
    if statistic_rides_with_products(x.dtype):
        out = x.new_empty(*x.shape[:-1], n + 1)  # [s, b, Σr + 1]
        out[..., n:].copy_(sumsq)
        return out, out[..., n:], None
    handle = None
    if get_pg_size(group) > 1:
        handle = torch.distributed.all_reduce(sumsq, group=group, async_op=True)
    return x.new_empty(*x.shape[:-1], n), sumsq, handle


def _down_project_gemm_all_reduce(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                                  group) -> None:
    """out[..., :n] = x · Wᵀ, then out all-reduced over ``group`` in place (the GEMM writes
    straight into the buffer the all-reduce reduces)."""
    x2d = x.reshape(-1, x.shape[-1])  # [s·b, d_in/t]
    out2d = out.view(-1, out.shape[-1])  # [s·b, Σr (+1)]
    torch.mm(x2d, w.t(), out=out2d[:, :w.shape[0]])
    if get_pg_size(group) == 1:
        return
    if not in_half():
        torch.distributed.all_reduce(out2d, group=group)
        return
    # an interleaved half: the other half runs up to its own all-reduce meanwhile
    handle = torch.distributed.all_reduce(out2d, group=group, async_op=True)
    hand_over()
    handle.wait()


def _down_project_record(log, out: torch.Tensor, sumsq: Optional[torch.Tensor]) -> None:
    """The reductions of a checkpointed forward, in issue order: one fused tensor when the
    statistic rides, else the products then the statistic (``parallel/recompute.py``)."""
    log.record(out)
    if sumsq is not None and not statistic_rides_with_products(out.dtype):
        log.record(sumsq)


def _down_project_replayed(log, n: int, dtype, with_statistic: bool):
    """The recorded reductions of a low-rank recompute, as the forward returned them."""
    first = log.next_recorded()
    if not with_statistic:
        return first.view_as(first)
    if statistic_rides_with_products(dtype):
        return first[..., :n], first[..., n:]
    return first.view_as(first), log.next_recorded().view_as(first[..., :1])


def _down_project_result(out: torch.Tensor, n: int, sumsq: Optional[torch.Tensor]):
    """P [s, b, Σr] (a view of the reduced buffer), and Σx² [s, b, 1] with the statistic."""
    products = out[..., :n] if out.shape[-1] != n else out
    return products if sumsq is None else (products, sumsq)


def _down_project_dgrad(g2d: torch.Tensor, w: torch.Tensor, x: torch.Tensor,
                        residual_slot) -> torch.Tensor:
    """dx = dP·W [s, b, d_in/t]; with the residual's gradient (``parallel/residual.py``)
    dx = d_res + dP·W, accumulated in the GEMM (beta = 1) into d_res's buffer: no separate add.
    In place: only the A side reads d_res from here on (the branch's backward is done)."""
    d_res = take_residual_gradient(residual_slot, x)
    if d_res is None:
        return torch.mm(g2d, w).view(x.shape)
    d_res.view(-1, w.shape[1]).addmm_(g2d, w)  # [s·b, d_in/t] += [s·b, Σr]·[Σr, d_in/t]
    return d_res


class _DownProjectAllReduceFwd(torch.autograd.Function):
    """boost's A side: P = Σ_ranks x_k · W_kᵀ, and with the fused norm the fp32 statistic
    Σ_ranks Σ x_k² (docs/design.md §3).

    fwd: the GEMM into the buffer (:func:`_down_project_buffer`), the all-reduce of the buffer
         in place; in a low-rank recompute the recorded results, no GEMM, no collective.
    bwd: no communication (the reduction's backward is the identity): dx = dP·W (+ 2·x·dΣx²,
         one kernel), dW = dPᵀ·x. When x is a residual tap's output (qkv, fc1), the GEMM
         accumulates into the residual's gradient (``parallel/residual.py``).
    """

    @staticmethod
    def forward(ctx, x, w, group, with_statistic: bool, fuse_wgrad: bool,
                link: Optional[GradientLink]):
        ctx.with_statistic, ctx.link = with_statistic, link
        ctx.save_for_backward(x, w)
        # dW into W's main_grad (parallel/wgrad.py); the γ-scaled A has none (its fold does it)
        ctx.main_grad = accumulation_target(w, fuse_wgrad, x.dtype)
        ctx.residual_slot = residual_slot_of(x)
        log = active_log() if get_pg_size(group) > 1 else None
        if log is not None and log.replaying:
            return _down_project_replayed(log, w.shape[0], x.dtype, with_statistic)
        out, sumsq, handle = _down_project_buffer(x, w.shape[0], group, with_statistic)
        _down_project_gemm_all_reduce(x, w, out, group)
        if handle is not None:
            handle.wait()
        if log is not None:
            _down_project_record(log, out, sumsq)
        return _down_project_result(out, w.shape[0], sumsq)

    @staticmethod
    def backward(ctx, d_products, d_sumsq=None):
        x, w = ctx.saved_tensors
        if ctx.link is not None:  # an interleaved half's dP, reduced beside the other half
            ctx.link.wait()
        g2d = d_products.reshape(-1, w.shape[0])  # [s·b, Σr]
        dx = _down_project_dgrad(g2d, w, x, ctx.residual_slot)  # [s, b, d_in/t]
        if ctx.with_statistic and d_sumsq is not None:
            dx.addcmul_(x, d_sumsq, value=2.0)  # + d(Σx²)/dx, in the same buffer
        x2d = x.reshape(-1, x.shape[-1])
        if ctx.main_grad is not None:  # [Σr, d_in/t], accumulated in the GEMM
            gemm_into(ctx.main_grad, g2d.t(), x2d, accumulate=True)
            return dx, dummy_gradient(w), None, None, None, None
        return dx, torch.mm(g2d.t(), x2d), None, None, None, None  # dW [Σr, d_in/t]


def down_project(x: torch.Tensor, w: torch.Tensor, group, with_statistic: bool = False,
                 fuse_wgrad: bool = False, link: Optional[GradientLink] = None):
    """boost's A side: ONE GEMM of the group's (γ-scaled) A factors on the local shard x
    [s, b, d_in/t] and ONE all-reduce of the partial products (Σr wide; with the statistic
    Σr + 1, or Σr and an fp32 1 in bf16). ``fuse_wgrad``: dW accumulates in W's main_grad
    (``parallel/wgrad.py``). ``link``: the group's :class:`GradientLink` (an interleaved
    half's backward waits on it). Inside an interleaved half the all-reduce is started and the
    other half runs until it hands back (``parallel/interleave.py``).
    Returns P [s, b, Σr], or (P, Σx² [s, b, 1]) ``with_statistic``
    (:class:`_DownProjectAllReduceFwd`)."""
    return _DownProjectAllReduceFwd.apply(x, w, group, with_statistic, fuse_wgrad, link)


# -- the B side: r -> d_out/t -------------------------------------------------------------------


def split_project(z: torch.Tensor, weights, ranks: Sequence[int]) -> List[torch.Tensor]:
    """y_p = z_p · W_p^T for each projection p; z: [s, b, Σr] split by ``ranks``.
    Local GEMMs only, no communication."""
    return [torch.matmul(zp, w.t()) for zp, w in zip(z.split(list(ranks), dim=-1), weights)]


def _up_project_gemms(z: torch.Tensor, b: torch.Tensor, geometry: BottleneckGeometry,
                      residual: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """y_p = z_p · B_pᵀ for each projection p, z [s, b, Σr] = [z_1 | z_2 | ...], B the grouped
    factor [Σ out_p, r]: with ``batched`` and equal shapes, one batched GEMM whose outputs share
    one buffer, else one GEMM per projection on its row view. With ``residual`` (one
    projection: the block's output) y = residual + z·Bᵀ in the GEMM (beta = 1)."""
    rows, ranks = geometry.rows, geometry.ranks
    if residual is not None:  # [s·b, d/t] = [s·b, d/t] + [s·b, r]·[r, d/t]
        y = torch.addmm(residual.reshape(-1, rows[0]), z.reshape(-1, ranks[0]), b.t())
        return [y.view(residual.shape)]  # [s, b, d/t]
    if geometry.batched and geometry.equal_shapes():
        g, r, out = len(rows), ranks[0], rows[0]
        zb = z.reshape(-1, g, r).transpose(0, 1)  # [G, s·b, r], strided: no copy
        y = torch.bmm(zb, b.view(g, out, r).transpose(1, 2))  # [G, s·b, out]
        return [y[i].view(*z.shape[:-1], out) for i in range(g)]  # [s, b, out] each
    return split_project(z, b.split(list(rows), dim=0), ranks)


def _up_project_dgrad(grads, b: torch.Tensor, rows: Sequence[int], ranks: Sequence[int],
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


def _up_project_wgrad(grads, z: torch.Tensor, b: torch.Tensor, rows: Sequence[int],
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


class _UpProjectAllReduceBwd(torch.autograd.Function):
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
    def forward(ctx, products, sumsq, b, geometry: BottleneckGeometry,
                link: Optional[GradientLink], residual: Optional[torch.Tensor]):
        ctx.geometry = geometry
        # an interleaved half reduces dP after σ' instead of dz before it (the A side waits)
        ctx.link = link if reduces_after_activation(link) else None
        ctx.main_grad = accumulation_target(b, geometry.fuse_wgrad, products.dtype)
        z = geometry.activation.forward(products, sumsq)  # [s, b, Σr]
        ctx.save_for_backward(products, sumsq, z, b)
        return tuple(_up_project_gemms(z, b, geometry, residual))

    @staticmethod
    def backward(ctx, *grads):
        products, sumsq, z, b = ctx.saved_tensors
        geo = ctx.geometry
        # [s·b, out_p/t] each; an unused output gets no gradient: treat it as zero
        grads = [g.reshape(-1, g.shape[-1]) if g is not None
                 else z.new_zeros(z.numel() // z.shape[-1], n) for g, n in zip(grads, geo.rows)]
        dz = _up_project_dgrad(grads, b, geo.rows, geo.ranks, z)  # [s, b, Σr], partial
        if ctx.link is not None:
            return (*_reduce_after_activation(ctx, products, sumsq, dz, grads, z, b),
                    None, None, None)
        handle = None
        if get_pg_size(geo.group) > 1:
            handle = torch.distributed.all_reduce(dz, group=geo.group, async_op=geo.overlap)
        db = _up_project_wgrad(grads, z, b, geo.rows, geo.ranks,
                               ctx.main_grad)  # [Σ out_p/t, r]
        if handle is not None and geo.overlap:
            handle.wait()
        d_products, d_sumsq = geo.activation.backward(products, sumsq, dz)
        # none for the residual: its gradient is the output's, which the bda routes
        return d_products, d_sumsq, db, None, None, None


def reduces_after_activation(link: Optional[GradientLink]) -> bool:
    """Whether a B side's backward leaves the all-reduce of dP to its A side: inside an
    interleaved half, where autograd runs the other half's segment between the two."""
    return link is not None and in_half()


def _reduce_after_activation(ctx, products, sumsq, dz, grads, z, b):
    """(dP, dΣx², dB) with dP and dΣx² all-reduced after σ' and the scale's gradient, left
    running for the A side (``ctx.link``). Exact: σ' and the scale are linear in dz, with
    coefficients every rank holds (P and Σx² are replicated after the forward all-reduce)."""
    geo = ctx.geometry
    d_products, d_sumsq = geo.activation.backward(products, sumsq, dz)  # partial sums
    if get_pg_size(geo.group) > 1:
        ctx.link.handles = [torch.distributed.all_reduce(t, group=geo.group, async_op=True)
                            for t in (d_products, d_sumsq) if t is not None]
    db = _up_project_wgrad(grads, z, b, geo.rows, geo.ranks, ctx.main_grad)
    return d_products, d_sumsq, db


def up_project(products: torch.Tensor, sumsq: Optional[torch.Tensor], b: torch.Tensor,
               geometry: BottleneckGeometry, link: Optional[GradientLink] = None,
               residual: Optional[torch.Tensor] = None) -> List[torch.Tensor]:
    """boost's B side on the reduced products P [s, b, Σr] (and the statistic, with the fused
    norm): [s, b, out_p/t] per projection, from the grouped B factor [Σ out_p/t, r].
    fwd: no communication; bwd: all-reduce of dz (Σr), overlapped with the dB GEMMs when
    ``geometry.overlap`` (:class:`_UpProjectAllReduceBwd`); inside an interleaved half, of
    dP after σ', waited for by the A side through ``link``. ``residual`` (detached, the
    block's output only): added in the GEMM; its gradient is the bda's to route
    (``parallel/residual.py``)."""
    return list(_UpProjectAllReduceBwd.apply(products, sumsq, b, geometry, link, residual))
