"""Every tensor-parallel collective of megatron-boost, as autograd Functions.

Each Function states both directions in its docstring. Each public wrapper returns its input
unchanged (or does the local equivalent) for a group of size 1, so a TP=1 run issues no
collective. Widths are per token (the last dimension) unless stated; r is a bottleneck rank,
d the hidden size, t the TP size. The model of this module is megatron-core's
``tensor_parallel/mappings.py``; where one of its mappings is exactly what a mode needs (the
naive mode's input copy and output reduce, the full-rank baseline) it is re-exported here rather
than rewritten, so that this file remains the one place to read for the project's TP traffic.

Accounting: :func:`record_collectives` records every collective issued on a given group while
it is active (kind, direction, group size, elements, bytes), including those issued by
megatron-core's own layers, by wrapping ``torch.distributed``'s entry points for the duration of
the ``with`` block only. Outside the block nothing is wrapped: the cost when disabled is zero.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator, List, Optional

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel import mappings as _mcore_mappings

__all__ = [
    "reduce_bottleneck",
    "reduce_bottleneck_product",
    "copy_to_bottleneck",
    "gather_hidden",
    "copy_to_tp_region",
    "reduce_from_tp_region",
    "bottleneck_up",
    "split_project",
    "column_parallel_in",
    "record_forward_reductions",
    "replay_forward_reductions",
    "record_collectives",
    "CollectiveRecord",
    "CommLog",
]


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    # Looked up on the module at call time so that record_collectives sees it.
    torch.distributed.all_reduce(x, group=group)
    return x


# --------------------------------------------------------------------------------------------
# boost mode
# --------------------------------------------------------------------------------------------


class _ReduceBottleneck(torch.autograd.Function):
    """Sum the rank-partial bottleneck products (and online-RMSNorm's partial sums of squares).

    fwd: all-reduce of the last dimension (r, or r + 1 with the fused sum of squares; for a
         group of projections, r_q + r_k + r_v + 1).
    bwd: identity. Everything downstream of the sum is computed identically on every rank and
         the gradient reaching it is complete (see copy_to_bottleneck), so each rank's partial
         receives the full gradient of the sum.
    """

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyToBottleneck(torch.autograd.Function):
    """Hand the replicated bottleneck activation σ(·) to the rank-local B factor.

    fwd: identity (the activation is already replicated).
    bwd: all-reduce of the gradient, width r (each rank's B holds only out/t output rows, so
         each rank's gradient w.r.t. the bottleneck is a partial sum).
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.group), None


class _GatherHidden(torch.autograd.Function):
    """All-gather the hidden-sharded residual stream before the head.

    fwd: all-gather along the last dimension, [s, b, d/t] -> [s, b, d] (width d).
    bwd: keep the local slice of the gradient. The gradient of the gathered tensor is complete
         and replicated on every rank (the output layer's own input copy all-reduces it), so the
         slice is exact and no collective is needed.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        t = _size(group)
        x = x.contiguous()
        out = torch.empty((t * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype,
                          device=x.device)  # [t·s, b, d/t]: shards concatenated along dim 0
        _mcore_mappings.dist_all_gather_func(out, x, group=group)
        out = out.view(t, *x.shape)  # [t, s, b, d/t]
        # [t, s, b, d/t] -> [s, b, t, d/t] -> [s, b, d]
        return out.movedim(0, -2).reshape(*x.shape[:-1], t * x.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        return _local_slice(grad, ctx.group), None


def _local_slice(x: torch.Tensor, group) -> torch.Tensor:
    t, k = _size(group), dist.get_rank(group)
    width = x.shape[-1] // t
    return x[..., k * width:(k + 1) * width].contiguous()  # [..., d/t]


def reduce_bottleneck(x: torch.Tensor, group) -> torch.Tensor:
    """fwd: all-reduce (width of x's last dim); bwd: identity. See _ReduceBottleneck.

    Inside :func:`record_forward_reductions` / :func:`replay_forward_reductions` (low-rank
    activation checkpointing) the result is cached, then served again without communicating.
    """
    if _size(group) == 1:
        return x
    return _cached_reduction(x, lambda t: _ReduceBottleneck.apply(t, group))


def copy_to_bottleneck(x: torch.Tensor, group) -> torch.Tensor:
    """fwd: identity; bwd: all-reduce (r). See _CopyToBottleneck."""
    if _size(group) == 1:
        return x
    return _CopyToBottleneck.apply(x, group)


def gather_hidden(x: torch.Tensor, group) -> torch.Tensor:
    """fwd: all-gather [s, b, d/t] -> [s, b, d]; bwd: local slice. See _GatherHidden."""
    if _size(group) == 1:
        return x
    return _GatherHidden.apply(x, group)


# --------------------------------------------------------------------------------------------
# naive mode and the full-rank baseline: megatron-core's own mappings, re-exported.
# --------------------------------------------------------------------------------------------


def copy_to_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """fwd: identity; bwd: all-reduce of the input gradient (width d_in).

    The input of a naive bottleneck chunk (replicated stream into a column-parallel A).
    megatron-core's ``copy_to_tensor_model_parallel_region``.
    """
    if _size(group) == 1:
        return x
    return _mcore_mappings.copy_to_tensor_model_parallel_region(x, group=group)


def reduce_from_tp_region(x: torch.Tensor, group) -> torch.Tensor:
    """fwd: all-reduce of the output (width d_out); bwd: identity.

    The output of a naive bottleneck chunk (row-parallel B). megatron-core's
    ``reduce_from_tensor_model_parallel_region``.
    """
    if _size(group) == 1:
        return x
    return _cached_reduction(
        x, lambda t: _mcore_mappings.reduce_from_tensor_model_parallel_region(t, group=group))


# --------------------------------------------------------------------------------------------
# backward overlap: the input-gradient all-reduce runs while the weight-gradient GEMMs proceed
# --------------------------------------------------------------------------------------------


def split_project(z: torch.Tensor, weights, ranks) -> List[torch.Tensor]:
    """y_p = z_p · W_p^T for each projection p; z: [s, b, Σr] split by ``ranks``.
    Local GEMMs only, no communication."""
    return [torch.matmul(zp, w.t()) for zp, w in zip(z.split(list(ranks), dim=-1), weights)]


class _BottleneckUp(torch.autograd.Function):
    """boost: y_p = z_p · B_p^T for each projection p of a group, z = [z_1 | z_2 | ...].

    fwd: identity on z (replicated) and the local GEMMs; no communication.
    bwd: dz (width Σr, partial: each rank holds out/t rows of B) is all-reduced ASYNCHRONOUSLY
         while the weight gradients dB_p = g_p^T z_p are computed, then waited on. Same
         collective as copy_to_bottleneck, overlapped with compute.
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
        if _size(ctx.group) > 1:
            dz = dz.contiguous()
            handle = torch.distributed.all_reduce(dz, group=ctx.group, async_op=True)
        zs = z.split(ctx.ranks, dim=-1)
        dws = [torch.matmul(g.reshape(-1, g.shape[-1]).t(), zp.reshape(-1, zp.shape[-1]))
               for g, zp in zip(grads, zs)]  # [out_p/t, r_p] each
        if handle is not None:
            handle.wait()
        return (dz, None, None, *dws)


def bottleneck_up(z: torch.Tensor, weights, ranks, group, overlap: bool = True):
    """boost's B factors of a group on the replicated bottleneck z (see _BottleneckUp).

    fwd: no communication; bwd: all-reduce of dz (Σr), overlapped with the dB GEMMs when
    ``overlap``, else issued first (copy_to_bottleneck) as in the plain autograd graph."""
    if not overlap:
        return split_project(copy_to_bottleneck(z, group), weights, ranks)
    return list(_BottleneckUp.apply(z, group, list(ranks), *weights))


class _ColumnParallelIn(torch.autograd.Function):
    """naive: h = x · A_local^T on the replicated input (megatron's column-parallel linear).

    fwd: the local GEMM; no communication.
    bwd: dx (width d_in, partial over ranks) is all-reduced ASYNCHRONOUSLY while dA = g^T x is
         computed: megatron's overlapped input-gradient all-reduce (ColumnParallelLinear's
         async grad reduction), so the naive baseline gets the same overlap as boost.
    """

    @staticmethod
    def forward(ctx, x, weight, group):
        ctx.group = group
        ctx.save_for_backward(x, weight)
        return torch.matmul(x, weight.t())

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        dx = torch.matmul(g, weight).contiguous()  # [s, b, d_in], partial over ranks
        handle = (torch.distributed.all_reduce(dx, group=ctx.group, async_op=True)
                  if _size(ctx.group) > 1 else None)
        dw = torch.matmul(g.reshape(-1, g.shape[-1]).t(), x.reshape(-1, x.shape[-1]))
        if handle is not None:
            handle.wait()
        return dx, dw, None


def column_parallel_in(x: torch.Tensor, weight: torch.Tensor, group,
                       overlap: bool = True) -> torch.Tensor:
    """naive's A factors on the replicated input: fwd GEMM; bwd all-reduce of dx (d_in),
    overlapped with the dA GEMM when ``overlap`` (see _ColumnParallelIn)."""
    if not overlap:
        return torch.matmul(copy_to_tp_region(x, group), weight.t())
    return _ColumnParallelIn.apply(x, weight, group)


# --------------------------------------------------------------------------------------------
# low-rank activation checkpointing: forward reductions recorded once, replayed in recompute
# --------------------------------------------------------------------------------------------

_REDUCTION_CACHE = threading.local()


class _ReplayReduce(torch.autograd.Function):
    """Recompute stand-in of a forward all-reduce: returns the result recorded in the first
    forward pass.

    fwd: no communication (the cached, already reduced tensor).
    bwd: identity, exactly as the reduction it replaces (fwd all-reduce, bwd identity).
    """

    @staticmethod
    def forward(ctx, x, cached):
        return cached.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReplayProduct(torch.autograd.Function):
    """Recompute stand-in of ``reduce_bottleneck([xin · A^T | Σ x²])``: the recorded result is
    returned and the partial product is NOT recomputed, since its gradient does not need it.

    fwd: no communication, no GEMM (the cached, already reduced [s, b, Σr (+1)]).
    bwd: what the product and the reduction would give: dxin = g_p · A, dA = (xin^T · g_p)^T
         (the same GEMMs, in the same form, as autograd's matmul backward), and, for the
         fused sum of squares, dx = g_ss · 2x. No communication (the reduction's bwd is identity).
    """

    @staticmethod
    def forward(ctx, xin, a, x_sumsq, cached):
        ctx.save_for_backward(xin, a, x_sumsq)
        return cached.clone()

    @staticmethod
    def backward(ctx, g):
        xin, a, x_sumsq = ctx.saved_tensors
        n = a.shape[0]
        g2d = g[..., :n].reshape(-1, n)  # [s·b, Σr]
        xin2d = xin.reshape(-1, xin.shape[-1])  # [s·b, d_in/t]
        dxin = g2d.mm(a).view(xin.shape)
        da = xin2d.t().mm(g2d).t()
        dx = None
        if x_sumsq is not None:
            g_ss = g[..., n:].float()  # [s, b, 1]
            dx = (g_ss * (2.0 * x_sumsq.float())).to(x_sumsq.dtype)
        return dxin, da, dx, None


def reduce_bottleneck_product(xin: torch.Tensor, a: torch.Tensor, group,
                              sumsq_of: Optional[torch.Tensor] = None) -> torch.Tensor:
    """boost's A side: the partial product xin · A^T ([s, b, Σr], partial over ranks), with
    online-RMSNorm's partial sum of squares of ``sumsq_of`` as one extra column, all-reduced in
    ONE collective. fwd: all-reduce (Σr + 1); bwd: identity (then the GEMMs' backward).

    In the recompute of low-rank activation checkpointing the recorded sum is returned without
    communicating and without recomputing the product (see _ReplayProduct)."""
    cache = getattr(_REDUCTION_CACHE, "cache", None)
    if cache is not None and cache[0] == "replay" and _size(group) > 1:
        return _ReplayProduct.apply(xin, a, sumsq_of, cache[1].pop(0))
    partial = torch.matmul(xin, a.t())  # [s, b, Σr]
    if sumsq_of is not None:
        # Sum of squares in fp32; it travels in the activation dtype with the products
        # (one collective), which is exact in fp32 and bf16-accurate in bf16.
        sumsq = sumsq_of.float().pow(2).sum(dim=-1, keepdim=True).to(partial.dtype)  # [s, b, 1]
        partial = torch.cat([partial, sumsq], dim=-1)  # [s, b, Σr + 1]
    return reduce_bottleneck(partial, group)


def _cached_reduction(x: torch.Tensor, reduce_fn):
    cache = getattr(_REDUCTION_CACHE, "cache", None)
    if cache is None:
        return reduce_fn(x)
    mode, store = cache
    if mode == "record":
        out = reduce_fn(x)
        store.append(out.detach())
        return out
    return _ReplayReduce.apply(x, store.pop(0))


@contextlib.contextmanager
def record_forward_reductions(store: list):
    """Forward reductions in the block run normally and append their results to ``store``."""
    prev = getattr(_REDUCTION_CACHE, "cache", None)
    _REDUCTION_CACHE.cache = ("record", store)
    try:
        yield store
    finally:
        _REDUCTION_CACHE.cache = prev


@contextlib.contextmanager
def replay_forward_reductions(store: list):
    """Forward reductions in the block return the recorded results, in order, without
    communicating (the recompute of low-rank activation checkpointing)."""
    prev = getattr(_REDUCTION_CACHE, "cache", None)
    _REDUCTION_CACHE.cache = ("replay", list(store))
    try:
        yield
    finally:
        _REDUCTION_CACHE.cache = prev


# --------------------------------------------------------------------------------------------
# accounting
# --------------------------------------------------------------------------------------------


@dataclass
class CollectiveRecord:
    """One collective seen by :func:`record_collectives`."""

    kind: str
    """'all_reduce', 'all_gather' or 'reduce_scatter'."""
    direction: str
    """'fwd' or 'bwd' (issued while autograd runs a backward pass)."""
    group_size: int
    """Number of ranks in the group."""
    numel: int
    """Elements handed to the collective by this rank (the full output for an all-gather)."""
    nbytes: int
    """numel times the element size."""
    width: int
    """Size of the last dimension of the tensor handed to the collective."""
    shape: tuple
    """Shape of that tensor."""


@dataclass
class CommLog:
    """The collectives recorded in one :func:`record_collectives` block."""

    records: List[CollectiveRecord] = field(default_factory=list)

    def select(self, direction: Optional[str] = None, kind: Optional[str] = None):
        return [r for r in self.records
                if (direction is None or r.direction == direction)
                and (kind is None or r.kind == kind)]

    def count(self, direction: Optional[str] = None, kind: Optional[str] = None) -> int:
        return len(self.select(direction, kind))

    def bytes(self, direction: Optional[str] = None, kind: Optional[str] = None) -> int:
        return sum(r.nbytes for r in self.select(direction, kind))

    def widths(self, direction: Optional[str] = None, kind: Optional[str] = None) -> List[int]:
        return [r.width for r in self.select(direction, kind)]

    def summary(self) -> dict:
        out = {}
        for d in ("fwd", "bwd"):
            out[d] = {"count": self.count(d), "bytes": self.bytes(d),
                      "widths": self.widths(d)}
        return out


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@contextlib.contextmanager
def record_collectives(group) -> Iterator[CommLog]:
    """Record every all-reduce / all-gather / reduce-scatter issued on ``group`` in the block.

    Collectives on other groups (data-parallel gradient reduction, pipeline p2p) are not
    recorded. Usage::

        with record_collectives(tp_group) as log:
            loss = model(x).sum(); loss.backward()
        log.count("fwd"), log.bytes("bwd")
    """
    log = CommLog()
    if group is None or _size(group) == 1:
        yield log
        return

    # Positional index of the group argument, and of the tensor whose size is recorded:
    # all_reduce(tensor, op, group); all_gather_into_tensor(output, input, group) records the
    # gathered output; reduce_scatter_tensor(output, input, op, group) records the full input.
    group_pos = {"all_reduce": 2, "all_gather": 2, "reduce_scatter": 3}
    tensor_pos = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 1}

    def wrap(fn, kind):
        def wrapped(*args, **kwargs):
            pos = group_pos[kind]
            grp = kwargs["group"] if "group" in kwargs else (args[pos] if len(args) > pos
                                                             else None)
            if grp is group:
                t = args[tensor_pos[kind]]
                # Width per token: an all-gather concatenates t inputs of [..., w/t] along
                # dim 0, so its per-token width is the input's last dim times t.
                width = (int(args[1].shape[-1]) * _size(group) if kind == "all_gather"
                         else int(t.shape[-1]) if t.dim() else 1)
                log.records.append(CollectiveRecord(
                    kind=kind, direction="bwd" if _in_backward() else "fwd",
                    group_size=_size(group), numel=t.numel(),
                    nbytes=t.numel() * t.element_size(), width=width, shape=tuple(t.shape)))
            return fn(*args, **kwargs)
        return wrapped

    targets = [
        (torch.distributed, "all_reduce", "all_reduce"),
        (torch.distributed, "all_gather_into_tensor", "all_gather"),
        (torch.distributed, "reduce_scatter_tensor", "reduce_scatter"),
        (_mcore_mappings, "dist_all_gather_func", "all_gather"),
        (_mcore_mappings, "dist_reduce_scatter_func", "reduce_scatter"),
    ]
    saved = []
    try:
        for owner, name, kind in targets:
            fn = getattr(owner, name)
            saved.append((owner, name, fn))
            setattr(owner, name, wrap(fn, kind))
        yield log
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)
