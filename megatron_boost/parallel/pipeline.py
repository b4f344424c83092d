"""boost's bottleneck group as one software pipeline over blocks of sequence positions
(``parallel.bottleneck_overlap_chunks`` > 1; docs/design.md §7).

A group computes y_p = B_p·σ(P_p) with P = all-reduce(x_k · W_kᵀ) (W: the γ-scaled A with the
fused norm, docs/design.md §3). Every operation after the A GEMM is row-wise (one token's row
of P gives that token's outputs), so the group can run block by block of tokens:

    forward, block i:  A GEMM(i) -> start AR(i) -> wait AR(i-1) -> σ(i-1) -> B GEMMs(i-1)
    backward, block i: dz GEMMs(i) -> start AR(i) -> dB GEMMs(i) -> wait AR(i-1)
                       -> σ'(i-1) -> dx GEMM(i-1) (+ the norm's term) -> dW GEMM(i-1)

so block i's forward all-reduce travels beside block i+1's A GEMM and block i-1's σ and B GEMMs,
and its backward all-reduce beside its own dB GEMMs, block i-1's σ', dx and dW GEMMs and block
i+1's dz and dB GEMMs. Only the last block's all-reduce has less beside it. The collectives move
the bytes of the one-block layer, in ``chunks`` times the count.

Exact: every row of P, z and y is computed by the same arithmetic as in one block; the weight
gradients (dB, dW: sums over tokens) are accumulated block by block in their GEMMs (beta = 1),
a different summation order (fp32: ~1e-7 relative, ``tests/test_pipeline.py``).

Memory: nothing beyond the one-block layer. The reduced buffer P [s·b, Σr (+1)], the outputs and
the input gradient are allocated whole and written block by block; z is kept as its blocks,
which together are the one-block layer's z.

Low-rank activation checkpointing (``parallel/recompute.py``): the checkpointed forward records
the reduced buffer (and, in bf16, the fp32 statistic) once all blocks are reduced; the recompute
replays it and runs only σ and the B GEMMs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from megatron.core.utils import get_pg_size

from megatron_boost.parallel.bottleneck import BottleneckActivation, BottleneckGeometry
from megatron_boost.parallel.online_rmsnorm import statistic_rides_with_products, sum_of_squares
from megatron_boost.parallel.recompute import active_log
from megatron_boost.parallel.residual import residual_slot_of, take_residual_gradient
from megatron_boost.parallel.wgrad import accumulation_target, dummy_gradient, gemm_into

__all__ = ["PipelinePlan", "row_blocks", "pipelined_bottleneck"]

Block = Tuple[int, int]


def row_blocks(rows_per_position: int, positions: int, chunks: int) -> List[Block]:
    """(first row, end row) of each of ``chunks`` blocks of whole sequence positions of a
    token-major [s·b, ·] matrix: contiguous row blocks, as equal as s allows."""
    bounds = [round(i * positions / chunks) for i in range(chunks + 1)]
    return [(a * rows_per_position, b * rows_per_position)
            for a, b in zip(bounds, bounds[1:]) if b > a]


@dataclass(frozen=True)
class PipelinePlan:
    """What a group's pipeline needs besides its tensors: the group's B side
    (:class:`~megatron_boost.parallel.bottleneck.BottleneckGeometry`), the blocks and whether
    the statistic rides."""

    geometry: BottleneckGeometry
    """The TP group, each projection's B rows and rank, σ, the backward overlap, the batched
    (shared-output) GEMM and the gradient fusion."""
    chunks: int
    """Blocks of sequence positions."""
    with_statistic: bool
    """Whether the fused norm's statistic is gathered with the products."""

    @property
    def group(self):
        return self.geometry.group

    @property
    def rows(self) -> Tuple[int, ...]:
        """Local rows of each projection's B factor (its output width)."""
        return self.geometry.rows

    @property
    def activation(self) -> BottleneckActivation:
        return self.geometry.activation

    @property
    def shared_output(self) -> bool:
        """The projections' outputs in one buffer (equal shapes; fc1, as its batched GEMM)."""
        return self.geometry.batched and self.geometry.equal_shapes()

    def reduces(self) -> bool:
        return get_pg_size(self.group) > 1

    def columns(self) -> List[Block]:
        """Each projection's (first, end) column of P and z."""
        ranks = self.geometry.ranks
        ends = [sum(ranks[:i + 1]) for i in range(len(ranks))]
        return list(zip([0] + ends[:-1], ends))


def _all_reduce(t: torch.Tensor, plan: PipelinePlan, async_op: bool = True):
    if not plan.reduces():
        return None
    return torch.distributed.all_reduce(t, group=plan.group, async_op=async_op)


def _reduced_buffer(x2d: torch.Tensor, x: torch.Tensor, n: int, plan: PipelinePlan):
    """The buffer the products are reduced in, [s·b, Σr (+1)], and the fp32 statistic
    [s·b, 1] (or None): with fp32 products it rides as the buffer's last column; with bf16 ones
    its own all-reduce is started here, before the first A GEMM (returned handle)."""
    rides = plan.with_statistic and statistic_rides_with_products(x.dtype)
    out = x2d.new_empty(x2d.shape[0], n + (1 if rides else 0))
    if not plan.with_statistic:
        return out, None, None
    sumsq = sum_of_squares(x).view(-1, 1)  # fp32 [s·b, 1]
    if rides:
        out[:, n:].copy_(sumsq)  # one value per token: the column rides along
        return out, out[:, n:], None
    return out, sumsq, _all_reduce(sumsq, plan)


def _output_buffers(z_rows: int, b: torch.Tensor, plan: PipelinePlan) -> List[torch.Tensor]:
    """Each projection's output [s·b, out_p/t], written block by block; one buffer for all of
    them with ``shared_output`` (the outputs then share a storage, as a batched GEMM's)."""
    if plan.shared_output:
        shared = b.new_empty(len(plan.rows), z_rows, plan.rows[0])  # [G, s·b, out]
        return list(shared.unbind(0))
    return [b.new_empty(z_rows, n) for n in plan.rows]


def _up_block(out: torch.Tensor, sumsq: Optional[torch.Tensor], n: int, b: torch.Tensor,
              ys: List[torch.Tensor], block: Block, plan: PipelinePlan,
              residual: Optional[torch.Tensor]) -> torch.Tensor:
    """σ and the B GEMMs of one block of the reduced products: ys[p][block] = z_p · B_pᵀ,
    plus the residual's rows in the GEMM (beta = 1) when given (the block's output, one
    projection: ``parallel/residual.py``). Returns the block's z [rows, Σr] (kept for dB)."""
    first, end = block
    z = plan.activation.forward(out[first:end, :n],
                                None if sumsq is None else sumsq[first:end])
    for y, w, (c0, c1) in zip(ys, b.split(list(plan.rows), dim=0), plan.columns()):
        if residual is None:
            torch.mm(z[:, c0:c1], w.t(), out=y[first:end])
        else:  # [rows, d/t] = [rows, d/t] + [rows, r]·[r, d/t]
            torch.addmm(residual[first:end], z[:, c0:c1], w.t(), out=y[first:end])
    return z


def _forward_blocks(x2d, w, b, out, sumsq, stat_handle, blocks: List[Block],
                    plan: PipelinePlan, gemm: bool, residual: Optional[torch.Tensor]):
    """The forward pipeline (module docstring); ``gemm`` False (a low-rank recompute: ``out``
    holds the recorded reduction) runs σ and the B GEMMs only; ``residual`` [s·b, d/t] is
    added in the B GEMMs. Returns (outputs, z blocks)."""
    n = w.shape[0]
    ys, zs, pending = _output_buffers(x2d.shape[0], b, plan), [], None
    for block in blocks + [None]:
        handle = None
        if block is not None and gemm:
            torch.mm(x2d[block[0]:block[1]], w.t(), out=out[block[0]:block[1], :n])
            handle = _all_reduce(out[block[0]:block[1]], plan)  # a row block: contiguous
        if pending is not None:
            if pending[1] is not None:
                pending[1].wait()
            if stat_handle is not None:
                stat_handle.wait()
                stat_handle = None
            zs.append(_up_block(out, sumsq, n, b, ys, pending[0], plan, residual))
        pending = None if block is None else (block, handle)
    return ys, zs


class _PipelinedBottleneck(torch.autograd.Function):
    """One boost group, A GEMM to outputs, pipelined over blocks of tokens (module docstring).

    fwd: x [s, b, d_in/t], W [Σr, d_in/t] (γ-scaled with the norm), B [Σ out_p/t, r] ->
         y_p [s, b, out_p/t]; keeps x, W, B, the reduced buffer, the statistic and z's blocks.
    bwd: dx, dW, dB; dz's all-reduce per block, beside the neighbouring blocks' GEMMs.
    """

    @staticmethod
    def forward(ctx, x, w, b, plan: PipelinePlan, residual: Optional[torch.Tensor]):
        x2d = x.reshape(-1, x.shape[-1])  # [s·b, d_in/t]
        if residual is not None:
            residual = residual.reshape(-1, residual.shape[-1])  # [s·b, d/t]
        log = active_log() if plan.reduces() else None
        replaying = log is not None and log.replaying
        if replaying:
            out, sumsq, stat_handle = _replayed_buffer(log, w.shape[0], x.dtype, plan)
        else:
            out, sumsq, stat_handle = _reduced_buffer(x2d, x, w.shape[0], plan)
        # blocks of whole sequence positions: x2d's rows are token-major, b rows per position
        blocks = row_blocks(x2d.shape[0] // x.shape[0], x.shape[0], plan.chunks)
        ys, zs = _forward_blocks(x2d, w, b, out, sumsq, stat_handle, blocks, plan,
                                 gemm=not replaying, residual=residual)
        if log is not None and not replaying:  # in issue order, once complete
            log.record(out)
            if plan.with_statistic and not statistic_rides_with_products(x.dtype):
                log.record(sumsq)
        ctx.plan, ctx.blocks = plan, blocks
        ctx.residual_slot = residual_slot_of(x)  # dx accumulates into d_res (parallel/residual.py)
        ctx.main_grads = (accumulation_target(w, plan.geometry.fuse_wgrad, x.dtype),
                          accumulation_target(b, plan.geometry.fuse_wgrad, x.dtype))
        ctx.save_for_backward(x, w, b, out, sumsq, *zs)
        return tuple(y.view(*x.shape[:-1], y.shape[-1]) for y in ys)  # [s, b, out_p/t] each

    @staticmethod
    def backward(ctx, *grads):
        x, w, b, out, sumsq, *zs = ctx.saved_tensors
        plan = ctx.plan
        rows = out.shape[0]
        # [s·b, out_p/t] each; an unused output gets no gradient: treat it as zero
        grads = [g.reshape(-1, g.shape[-1]) if g is not None else b.new_zeros(rows, n)
                 for g, n in zip(grads, plan.rows)]
        d_res = take_residual_gradient(ctx.residual_slot, x)  # [s, b, d_in/t] or None
        dx, dw, db = _backward_blocks(x.reshape(-1, x.shape[-1]), w, b, out, sumsq, zs,
                                      grads, ctx.blocks, plan, ctx.main_grads, d_res)
        # a factor whose gradient went into its main_grad returns the dummy (parallel/wgrad.py)
        dw, db = [dummy_gradient(p) if mg is not None else d
                  for p, mg, d in zip((w, b), ctx.main_grads, (dw, db))]
        return dx.view(x.shape), dw, db, None, None  # the residual's: the bda routes it


def _replayed_buffer(log, n: int, dtype, plan: PipelinePlan):
    """The recorded reduction of a low-rank recompute, as :func:`_reduced_buffer` leaves it
    once reduced."""
    out = log.next_recorded()
    if not plan.with_statistic:
        return out, None, None
    if statistic_rides_with_products(dtype):
        return out, out[:, n:], None
    return out, log.next_recorded(), None


def _dz_block(grads, b, dz, block: Block, plan: PipelinePlan) -> None:
    """dz[block] = [g_1·B_1 | g_2·B_2 | ...]: each projection's GEMM writes its columns."""
    first, end = block
    for g, w, (c0, c1) in zip(grads, b.split(list(plan.rows), dim=0), plan.columns()):
        torch.mm(g[first:end], w, out=dz[first:end, c0:c1])


def _db_block(grads, z, db, block: Block, plan: PipelinePlan, accumulate: bool) -> None:
    """dB_p += g_p[block]ᵀ · z_p[block]: each projection's rows of the grouped gradient,
    accumulated in the GEMM after the first block."""
    first, end = block
    for g, d, (c0, c1) in zip(grads, db.split(list(plan.rows), dim=0), plan.columns()):
        gemm_into(d, g[first:end].t(), z[:, c0:c1], accumulate)


def _a_backward_block(x2d, w, out, sumsq, dz, dx, dw, block: Block, plan: PipelinePlan,
                      accumulate: bool, into_dx: bool) -> None:
    """σ' (and the norm's scale) of one block, then dx[block] = dP·W (+ 2·x·dΣx²) and
    dW += dPᵀ·x[block]; ``into_dx``: dx[block] holds the residual's gradient, which the GEMM
    adds to (beta = 1)."""
    first, end = block
    n = w.shape[0]
    d_products, d_sumsq = plan.activation.backward(
        out[first:end, :n], None if sumsq is None else sumsq[first:end], dz[first:end])
    if into_dx:
        dx[first:end].addmm_(d_products, w)  # a row block: contiguous
    else:
        torch.mm(d_products, w, out=dx[first:end])
    if d_sumsq is not None:
        dx[first:end].addcmul_(x2d[first:end], d_sumsq, value=2.0)
    gemm_into(dw, d_products.t(), x2d[first:end], accumulate)


def _backward_blocks(x2d, w, b, out, sumsq, zs, grads, blocks: List[Block],
                     plan: PipelinePlan, main_grads, d_res: Optional[torch.Tensor]):
    """The backward pipeline (module docstring). Returns (dx, dW, dB), dx [s·b, d_in/t]
    (accumulated into ``d_res``, the residual's gradient, where there is one); dW and dB are
    the factors' main_grad, accumulated into from the first block, where ``main_grads`` names
    them (else fresh, accumulated into after the first block)."""
    dz = x2d.new_empty(x2d.shape[0], w.shape[0])  # [s·b, Σr], partial until reduced
    dx = torch.empty_like(x2d) if d_res is None else d_res.view_as(x2d)  # [s·b, d_in/t]
    dw, db = [mg if mg is not None else torch.empty_like(p) for p, mg in zip((w, b), main_grads)]
    into_w, into_b = (mg is not None for mg in main_grads)
    pending = None
    for i, block in enumerate(blocks + [None]):
        handle = None
        if block is not None:
            _dz_block(grads, b, dz, block, plan)
            handle = _all_reduce(dz[block[0]:block[1]], plan, async_op=plan.geometry.overlap)
            _db_block(grads, zs[i], db, block, plan, accumulate=into_b or i > 0)
        if pending is not None:
            if pending[1] is not None and plan.geometry.overlap:
                pending[1].wait()
            _a_backward_block(x2d, w, out, sumsq, dz, dx, dw, pending[0], plan,
                              accumulate=into_w or i > 1, into_dx=d_res is not None)
        pending = None if block is None else (block, handle)
    return dx, dw, db


def pipelined_bottleneck(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor,
                         plan: PipelinePlan, residual: Optional[torch.Tensor] = None
                         ) -> List[torch.Tensor]:
    """A boost group's outputs [s, b, out_p/t] from its hidden-, head- or ffn-sharded input x
    [s, b, d_in/t], the (γ-scaled) grouped A factor W and the grouped B factor, pipelined over
    ``plan.chunks`` blocks of sequence positions (:class:`_PipelinedBottleneck`). ``residual``
    (detached, the block's output only) is added in the B GEMMs."""
    return list(_PipelinedBottleneck.apply(x, w, b, plan, residual))
