"""Stand-ins for the fused kernels of a CUDA run that the CPU cannot run, while the op ledger
records (``measure/ledger.py``, docs/design.md §17): each the kernels the CUDA library
launches forward and backward, reading its inputs and writing its results, with the eager
computation inside (the CPU's own kernels, counted apart), and keeping for backward what the
library keeps."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

__all__ = ["CUDA_KERNEL_MODELS", "ATTENTION_FLOP_SHARE", "cuda_kernel_models"]

#: The stand-ins for CUDA kernels the CPU cannot run (module docstring).
CUDA_KERNEL_MODELS = {
    "rope": "Transformer Engine's fused RoPE (megatron's apply_rope_fusion): one kernel forward "
            "and one backward per tensor, keeping only the frequencies",
    "rms_norm": "Transformer Engine's RMSNorm (TENorm): one kernel forward; backward one "
                "kernel for dx and the per-block fp32 partial sums of dgamma, and one that "
                "reduces them",
    "swiglu": "megatron's fused SwiGLU (bias_activation_fusion, jit_fuser): one kernel forward "
              "and one backward",
    "wgrad_accumulation": "apex's fused_weight_gradient_mlp_cuda (megatron's linears with "
                          "gradient_accumulation_fusion): the weight-gradient GEMM adding into "
                          "the fp32 main_grad in place",
    "attention": "a flash attention kernel (FlashAttention-2/3, cuDNN, Transformer Engine) in "
                 "place of the CPU's SDPA: one kernel forward keeping the fp32 log-sum-exp; "
                 "backward three: rowsum(dO*O) with the fp32 dQ accumulator zeroed, the main "
                 "kernel (dK, dV, dQ accumulated in fp32), dQ's conversion",
}

#: The attention stand-ins' kernels that do the core's matmuls, and their FLOPs as a multiple of
#: the causal forward's (QK^T and PV): backward recomputes QK^T and computes dV, dP, dQ and dK,
#: five matmuls against two (FlashAttention-2, Dao 2023, section 3.1.2).
ATTENTION_FLOP_SHARE = {"attention": 1.0, "attention_backward": 2.5}


def _keep_for_backward(ctx, args, linear: bool) -> None:
    """Save what a modeled kernel's backward needs: the tensor arguments (the input of a map
    linear in it only as its shape: its vector-Jacobian product does not read it), the other
    arguments as they are, and which arguments want a gradient."""
    import torch

    ctx.n_args = len(args)
    ctx.grad_of = [i for i, a in enumerate(args)
                   if isinstance(a, torch.Tensor) and a.requires_grad]
    kept = [a if isinstance(a, torch.Tensor) else None for a in args]
    if linear:  # the vjp of a linear map needs only the input's shape, not the input
        ctx.linear_input = (args[0].shape, args[0].dtype, args[0].device)
        kept[0] = None
    ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
    ctx.save_for_backward(*[k for k in kept if k is not None])
    ctx.tensor_pos = [i for i, k in enumerate(kept) if k is not None]


def _kept_args(ctx, linear: bool) -> list:
    """The arguments :func:`_keep_for_backward` saved, in order (a linear map's input as a
    placeholder of its shape, made in backward, not kept)."""
    import torch

    saved = dict(zip(ctx.tensor_pos, ctx.saved_tensors))
    args = [saved.get(i, ctx.others[i]) for i in range(ctx.n_args)]
    if linear:
        shape, dtype, device = ctx.linear_input
        args[0] = torch.empty(shape, dtype=dtype, device=device)
    return args


def _vjp(fn: Callable, args: list, grad_of: list) -> Callable:
    """The backward kernel of ``fn`` at ``args``: (the differentiable arguments, the output's
    gradient) -> their gradients, each written into a fresh, dense tensor."""
    import torch

    def vjp(*tensors_and_grad):
        *inputs, g = tensors_and_grad
        with torch.enable_grad():
            live = list(args)
            for i, t in zip(grad_of, inputs):
                live[i] = t.detach().requires_grad_(True)
            grads = torch.autograd.grad(fn(*live), [live[i] for i in grad_of], g)
        return tuple(t.contiguous() for t in grads)

    return vjp


def _modeled_kernel(name: str, fn: Callable, linear: bool = False):
    """``fn`` as one fused kernel forward and one backward, as the CUDA kernel it stands for:
    forward, a region reading its tensor arguments and writing its result; backward, a region
    computing the vector-Jacobian product of ``fn`` (at a zero input when ``fn`` is linear in
    its first argument, so that nothing but the other arguments is saved, as TE's fused RoPE
    saves only the frequencies: Transformer Engine's ``FusedRoPEFunc`` saves ``freqs`` and
    nothing of the tensor it rotates)."""
    import torch

    from megatron_boost.parallel.fusion import observed_call

    class _Kernel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, n_args, *flat):
            args = flat[:n_args]
            _keep_for_backward(ctx, args, linear)
            with torch.no_grad():
                return observed_call(name, fn, *args)

        @staticmethod
        def backward(ctx, grad):
            args = _kept_args(ctx, linear)
            grads = observed_call(f"{name}_backward", _vjp(fn, args, ctx.grad_of),
                                  *[args[i] for i in ctx.grad_of], grad)
            full = [None] * ctx.n_args
            for i, g in zip(ctx.grad_of, grads):
                full[i] = g
            return (None, *full)

    def call(*args):
        return _Kernel.apply(len(args), *args)

    return call


#: Rows of fp32 partial sums of dgamma that Transformer Engine's RMSNorm backward writes, one
#: per block of rows (``rmsnorm_bwd``'s ``dgamma_part`` workspace, reduced by its
#: ``rmsnorm_bwd_finalize`` kernel); assumption: about one per SM of an H100 (132).
NORM_DGAMMA_PARTS = 128


def _modeled_norm():
    """torch's RMSNorm as Transformer Engine's kernels (``TENorm``, ``transformer_engine``'s
    ``rmsnorm_fwd`` / ``rmsnorm_bwd`` + ``rmsnorm_bwd_finalize``): one kernel forward
    (keeping the input and the weight); backward one kernel writing dx and the fp32 partial
    sums of dgamma per block of rows, and one reducing them into dgamma."""
    import torch

    from megatron_boost.parallel.fusion import observed_call

    class _Norm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, shape, weight, eps):
            ctx.shape, ctx.eps = shape, eps
            ctx.save_for_backward(x, weight)
            return observed_call("rms_norm", torch.rms_norm, x, shape, weight, eps)

        @staticmethod
        def backward(ctx, grad):
            x, weight = ctx.saved_tensors

            def dx_and_parts(x, weight, g):
                with torch.enable_grad():
                    live = [x.detach().requires_grad_(True), weight.detach().requires_grad_(True)]
                    dx, dw = torch.autograd.grad(
                        torch.rms_norm(live[0], ctx.shape, live[1], ctx.eps), live, g)
                parts = (dw.float() / NORM_DGAMMA_PARTS).expand(NORM_DGAMMA_PARTS, -1)
                return dx.contiguous(), parts.contiguous()  # [parts, hidden] fp32

            dx, parts = observed_call("rms_norm_backward", dx_and_parts, x, weight, grad)
            dw = observed_call("rms_norm_backward_finalize",
                               lambda p: p.sum(0).to(weight.dtype), parts)
            return dx, None, dw, None

    generic = _modeled_kernel("rms_norm", torch.rms_norm)

    def call(x, shape, weight, eps):
        if weight is None or not weight.requires_grad:
            return generic(x, shape, weight, eps)
        return _Norm.apply(x, shape, weight, eps)

    return call


def _like(ref, t):
    """``t`` written where a kernel allocating its result as ``ref`` (empty_like) writes it."""
    import torch

    return torch.empty_like(ref).copy_(t)


def _flash_backward(call: Callable, q, k, v, out, lse, grad):
    """The three backward kernels FlashAttention-2 launches (``run_mha_bwd``:
    ``flash_bwd_dot_do_o_kernel``, the main ``flash_bwd_dq_dk_dv`` kernel,
    ``flash_bwd_convert_dq_kernel``), as FlashAttention-3 and cuDNN's fused attention do too (a
    preprocess, the main kernel, dQ's postprocess): rowsum(dO * O) into fp32 [b, h, s] with the
    fp32 dQ accumulator zeroed; the main kernel reading q, k, v, the output, the log-sum-exp,
    the gradient and D, writing dk, dv in the layouts of k, v and adding dQ into the
    accumulator (its atomic adds counted as one read and one write, a lower bound); dQ
    converted to q's dtype and layout. (The CPU's kernel returns its gradients in its own
    layout, which megatron's [s, b, h, e] views would then copy.)"""
    import torch

    from megatron_boost.parallel.fusion import observed_call

    def preprocess(out, g):  # D = rowsum(dO * O), and the dQ accumulator zeroed
        return (out.float() * g.float()).sum(-1), torch.zeros_like(q, dtype=torch.float32)

    def main(q, k, v, out, lse, g, delta, dq_accum):  # dK, dV; dQ accumulated in fp32
        with torch.enable_grad():
            live = [t.detach().requires_grad_(True) for t in (q, k, v)]
            dq, dk, dv = torch.autograd.grad(call(*live), live, g)
        return dq_accum.add_(dq.float()), _like(k, dk), _like(v, dv)

    delta, dq_accum = observed_call("attention_backward_preprocess", preprocess, out, grad)
    dq_accum, dk, dv = observed_call("attention_backward", main, q, k, v, out, lse, grad,
                                     delta, dq_accum, kind="attention")
    dq = observed_call("attention_backward_convert_dq", lambda a: _like(q, a), dq_accum)
    return dq, dk, dv


def _modeled_attention(sdpa: Callable):
    """torch's SDPA as the flash kernels a GPU runs: one kernel forward writing the output in
    the layout of q (and the fp32 log-sum-exp [b, h, s] it keeps); backward the three kernels
    of :func:`_flash_backward`."""
    import functools

    import torch

    from megatron_boost.parallel.fusion import observed_call

    class _Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, call):
            out = observed_call("attention", lambda q, k, v: _like(q, call(q, k, v)), q, k, v,
                                kind="attention")
            lse = q.new_empty(q.shape[:-1], dtype=torch.float32)  # [b, h, s]
            ctx.call = call
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad):
            return (*_flash_backward(ctx.call, *ctx.saved_tensors, grad), None)

    def call(q, k, v, **kwargs):
        return _Attention.apply(q, k, v, functools.partial(sdpa, **kwargs))

    return call


def _wgrad_accumulation():
    """(owner, name, stand-in) for apex's wgrad kernel in megatron's linear layers: the GEMM
    ``main_grad += grad_outputᵀ · input`` (one ``addmm_``), and the dummy gradient megatron
    then hands autograd (TE's ``get_dummy_wgrad``: an allocation, no kernel)."""
    import types

    import torch
    from megatron.core.tensor_parallel import layers

    def accumulate(total_input, grad_output, main_grad):
        main_grad.addmm_(grad_output.flatten(0, -2).t(), total_input.flatten(0, -2))

    def dummy_wgrad(shape, dtype, zero=False):
        return (torch.zeros if zero else torch.empty)(shape, dtype=dtype)

    apex = types.SimpleNamespace(wgrad_gemm_accum_fp32=accumulate,
                                 wgrad_gemm_accum_fp16=accumulate)
    return [(layers, "fused_weight_gradient_mlp_cuda", apex),
            (layers, "_grad_accum_fusion_available", True),
            (layers, "HAVE_TE", True), (layers, "get_dummy_wgrad", dummy_wgrad)]


@contextlib.contextmanager
def cuda_kernel_models() -> Iterator[None]:
    """While the ledger records: megatron's unfused RoPE, torch's RMSNorm and megatron's
    compiled SwiGLU replaced by the stand-ins of :data:`CUDA_KERNEL_MODELS` (process-wide, as
    ``record_collectives`` replaces the collectives; undone on exit)."""
    import functools

    import torch
    import torch.nn.functional as F
    from megatron.core.fusions import fused_bias_swiglu
    from megatron.core.models.common.embeddings import rope_utils

    from megatron_boost.parallel.fusion import observed_call
    from megatron_boost.parallel.wgrad import mixed_dtype_gemm_assumed

    def eager(fn):  # megatron's jit_fuser'd functions: the function it compiled
        return getattr(fn, "_torchdynamo_orig_callable", None) or getattr(fn, "__wrapped__", fn)

    swiglu, swiglu_back = eager(fused_bias_swiglu.swiglu), eager(fused_bias_swiglu.swiglu_back)
    rope = rope_utils._apply_rotary_pos_emb_bshd
    norm = _modeled_norm()  # ATen's rms_norm inside: F.rms_norm is replaced

    def modeled_rope(t, freqs, **options):  # the options are flags and numbers
        return _modeled_kernel("rope", functools.partial(rope, **options), linear=True)(t, freqs)

    def modeled_norm(input, normalized_shape, weight=None, eps=None):  # F.rms_norm's signature
        return norm(input, tuple(normalized_shape), weight, eps)

    replaced = [
        (rope_utils, "_apply_rotary_pos_emb_bshd", modeled_rope),
        (F, "rms_norm", modeled_norm),
        (F, "scaled_dot_product_attention",
         _modeled_attention(F.scaled_dot_product_attention)),
        (fused_bias_swiglu, "swiglu", lambda y: observed_call("swiglu", swiglu, y)),
        (fused_bias_swiglu, "swiglu_back",
         lambda g, y: observed_call("swiglu_backward", swiglu_back, g, y)),
    ]
    replaced += _wgrad_accumulation()
    absent = object()  # apex's and TE's names are missing where they do not import
    saved = [(owner, name, getattr(owner, name, absent)) for owner, name, _ in replaced]
    try:
        for owner, name, fn in replaced:
            setattr(owner, name, fn)
        with mixed_dtype_gemm_assumed(True):  # CUDA's bf16 -> fp32 wgrad GEMM (parallel/wgrad.py)
            yield
    finally:
        for owner, name, fn in saved:
            if fn is absent:
                delattr(owner, name)
            else:
                setattr(owner, name, fn)
