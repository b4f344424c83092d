"""Factor weight gradients accumulated in their GEMM (docs/design.md §7): megatron's
``gradient_accumulation_fusion`` contract for the bottleneck factors.

megatron's DDP gives every parameter an fp32 (or param-dtype) ``main_grad`` in its gradient
buffer and a hook that adds ``param.grad`` into it after each backward, unless
``param.grad_added_to_main_grad`` is set. megatron's own tensor-parallel linears
(``LinearWithGradAccumulationAndAsyncCommunication``) write their weight gradient straight into ``main_grad`` in the
GEMM (beta = 1) when the config's ``gradient_accumulation_fusion`` is on and the parameter has
a ``main_grad``, set ``grad_added_to_main_grad`` and return a dummy gradient, so the hook adds
nothing: one GEMM instead of a GEMM, a gradient tensor and an add kernel per factor.

The bottleneck layers' weight-gradient GEMMs follow the same contract
(``BoostTransformerConfig.bottleneck_grad_accumulation_fusion``). megatron's kernel for it is
apex's CUDA ``fused_weight_gradient_mlp_cuda``; here the GEMM is torch's ``addmm`` into
``main_grad``: ``main_grad.addmm_(a, b)`` when the operands have main_grad's dtype (fp32
training, or bf16 main grads), ``torch.addmm(..., out_dtype=fp32, out=main_grad)`` for bf16
operands where torch has that kernel (CUDA). Where it has neither (bf16 operands with fp32 main
grads on the CPU), the gradient is returned as usual and megatron's hook adds it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator, Optional

import torch

__all__ = ["accumulation_target", "mixed_dtype_gemm_assumed", "gemm_into", "dummy_gradient", "column_parallel_a",
           "row_parallel_b"]


#: The answer of :func:`_mixed_dtype_addmm` while :func:`mixed_dtype_gemm_assumed` holds one.
_ASSUMED: Optional[bool] = None


@contextlib.contextmanager
def mixed_dtype_gemm_assumed(answer: bool) -> Iterator[None]:
    """While it holds, the mixed-dtype GEMM is taken to exist (or not) without asking the
    device: the op ledger models a CUDA layer on the CPU (``measure/kernel_models.py``)."""
    global _ASSUMED
    saved, _ASSUMED = _ASSUMED, answer
    try:
        yield
    finally:
        _ASSUMED = saved


def _mixed_dtype_addmm(device_type: str, operand: torch.dtype, accumulator: torch.dtype) -> bool:
    """Whether torch has an addmm of ``operand`` matrices into an ``accumulator`` output on
    this device (the ``out_dtype`` overload: CUDA builds; not the CPU's)."""
    return _ASSUMED if _ASSUMED is not None else _probe(device_type, operand, accumulator)


@functools.lru_cache(maxsize=None)
def _probe(device_type: str, operand: torch.dtype, accumulator: torch.dtype) -> bool:
    """Asked once per device and dtypes, by trying it on real tensors: an unsupported call
    raises; nothing is read back to the host. Any active dispatch mode (a fake-tensor mode
    accepts every call) is set aside, so the cached answer is the device's."""
    from torch.utils._python_dispatch import _disable_current_modes

    try:  # any failure (no such overload, kernel or device) means: not here
        with _disable_current_modes():
            device = torch.device(device_type)
            c = torch.zeros(1, 1, dtype=accumulator, device=device)
            a = torch.ones(1, 1, dtype=operand, device=device)
            torch.addmm(c, a, a, out_dtype=accumulator, out=c)
    except Exception:  # noqa: BLE001
        return False
    return True


def accumulation_target(param: torch.Tensor, enabled: bool,
                        operand_dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``param.main_grad`` when the weight-gradient GEMMs of ``param`` accumulate into it:
    the fusion is on, megatron's DDP gave the parameter a ``main_grad``, and a GEMM of
    ``operand_dtype`` matrices can write it; else None (the gradient is returned as usual)."""
    main_grad = getattr(param, "main_grad", None) if enabled else None
    if main_grad is None:
        return None
    if main_grad.dtype == operand_dtype:
        return main_grad
    if _mixed_dtype_addmm(main_grad.device.type, operand_dtype, main_grad.dtype):
        return main_grad
    return None


def gemm_into(dst: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """dst = a·b, or dst += a·b in the same GEMM (beta = 1), dst in its own dtype (fp32 main
    grads from bf16 operands: the ``out_dtype`` GEMM)."""
    if dst.dtype != a.dtype:
        if not accumulate:
            dst.zero_()
        torch.addmm(dst, a, b, out_dtype=dst.dtype, out=dst)
    elif accumulate:
        dst.addmm_(a, b)
    else:
        torch.mm(a, b, out=dst)


def dummy_gradient(param: torch.Tensor) -> Optional[torch.Tensor]:
    """What the backward returns for a parameter whose gradient went into ``main_grad``:
    as megatron's linears, ``grad_added_to_main_grad`` set (megatron's DDP hook then adds
    nothing) and an uninitialised tensor of the parameter's shape, so the hook still runs on
    the backward's thread (megatron's reason: overlapped gradient reduction); None for a
    parameter that DDP does not track."""
    if not hasattr(param, "grad_added_to_main_grad"):
        return None
    param.grad_added_to_main_grad = True
    return torch.empty(param.shape, dtype=param.dtype, device=param.device)


# ---------------------------------------------------------------------------------------------
# naive's factors (boost's accumulate in parallel/bottleneck.py and parallel/pipeline.py)
# ---------------------------------------------------------------------------------------------


class _ColumnParallelA(torch.autograd.Function):
    """naive's column-parallel A factor with its gradient accumulated in ``main_grad``.

    fwd: y = x·Aᵀ ([s, b, d_in] -> [s, b, Σr/t]); no communication.
    bwd: dx = g·A, all-reduced over the TP group (asynchronously beside the dA GEMM with
         ``overlap``), and A.main_grad += gᵀ·x in the GEMM. megatron's column-parallel linear
         (``compat.linear_with_dgrad_allreduce``) does the same, but accumulates with apex's
         CUDA kernel only, so the layers use it without the fusion and this with it.
    """

    @staticmethod
    def forward(ctx, x, a, main_grad, group, overlap):
        ctx.save_for_backward(x, a)
        ctx.main_grad, ctx.group, ctx.overlap = main_grad, group, overlap
        return torch.matmul(x, a.t())

    @staticmethod
    def backward(ctx, grad):
        from megatron.core.utils import get_pg_size

        x, a = ctx.saved_tensors
        dx = torch.matmul(grad, a)  # [s, b, d_in], partial over the ranks
        handle = None
        if get_pg_size(ctx.group) > 1:
            handle = torch.distributed.all_reduce(dx, group=ctx.group, async_op=ctx.overlap)
        gemm_into(ctx.main_grad, grad.reshape(-1, grad.shape[-1]).t(),
                  x.reshape(-1, x.shape[-1]), accumulate=True)
        if handle is not None and ctx.overlap:
            handle.wait()
        return dx, dummy_gradient(a), None, None, None


def column_parallel_a(x: torch.Tensor, a: torch.Tensor, main_grad: torch.Tensor, group,
                      overlap: bool) -> torch.Tensor:
    """naive's x·Aᵀ whose dA accumulates in ``main_grad`` (:class:`_ColumnParallelA`)."""
    return _ColumnParallelA.apply(x, a, main_grad, group, overlap)


class _RowParallelB(torch.autograd.Function):
    """naive's B factors of a group with their gradient accumulated in ``main_grad``.

    fwd: out[:, cols_p] = h_p·B_pᵀ, each projection's GEMM writing its columns of one
         [s, b, Σ d_out] buffer (the buffer the forward all-reduce then reduces).
    bwd: dh_p = g_p·B_p into its columns of dh, and B.main_grad[rows_p] += g_pᵀ·h_p in the GEMM.
    """

    @staticmethod
    def forward(ctx, h, b, main_grad, rows, ranks):
        ctx.save_for_backward(h, b)
        ctx.main_grad, ctx.rows, ctx.ranks = main_grad, rows, ranks
        h2d = h.reshape(-1, h.shape[-1])  # [s·b, Σr/t]
        out = h.new_empty(h2d.shape[0], sum(rows))  # [s·b, Σ d_out]
        for w, (o0, o1), (c0, c1) in zip(b.split(rows, dim=0), _spans(rows), _spans(ranks)):
            torch.mm(h2d[:, c0:c1], w.t(), out=out[:, o0:o1])
        return out.view(*h.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        h, b = ctx.saved_tensors
        h2d, g2d = h.reshape(-1, h.shape[-1]), grad.reshape(-1, grad.shape[-1])
        dh = torch.empty_like(h2d)  # [s·b, Σr/t]
        for w, mg, (o0, o1), (c0, c1) in zip(b.split(ctx.rows, dim=0),
                                             ctx.main_grad.split(ctx.rows, dim=0),
                                             _spans(ctx.rows), _spans(ctx.ranks)):
            torch.mm(g2d[:, o0:o1], w, out=dh[:, c0:c1])
            gemm_into(mg, g2d[:, o0:o1].t(), h2d[:, c0:c1], accumulate=True)
        return dh.view(h.shape), dummy_gradient(b), None, None, None


def _spans(sizes):
    """(first, end) of consecutive blocks of the given sizes."""
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    return list(zip([0] + ends[:-1], ends))


def row_parallel_b(h: torch.Tensor, b: torch.Tensor, main_grad: torch.Tensor, rows, ranks
                   ) -> torch.Tensor:
    """naive's group output [s, b, Σ d_out] (partial until the all-reduce) whose dB
    accumulates in ``main_grad`` (:class:`_RowParallelB`)."""
    return _RowParallelB.apply(h, b, main_grad, list(rows), list(ranks))
