"""Stand-ins for the fused kernels of a CUDA run that the CPU cannot run, while the op ledger
records (``analysis/ledger.py``, docs/design.md §17): each one fused kernel forward and one
backward, reading its inputs and writing its results, with the eager computation inside (the
CPU's own kernels, counted apart)."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

__all__ = ["CUDA_KERNEL_MODELS", "ATTENTION_FLOP_SHARE", "cuda_kernel_models"]

#: The stand-ins for CUDA kernels the CPU cannot run (module docstring).
CUDA_KERNEL_MODELS = {
    "rope": "Transformer Engine's fused RoPE (megatron's apply_rope_fusion): one kernel forward "
            "and one backward per tensor",
    "rms_norm": "a fused RMSNorm (Transformer Engine's TENorm; torch's fused rms_norm): one "
                "kernel forward and one backward",
    "swiglu": "megatron's fused SwiGLU (bias_activation_fusion, jit_fuser): one kernel forward "
              "and one backward",
    "attention": "a flash attention kernel (FlashAttention-2, cuDNN, Transformer Engine) in "
                 "place of the CPU's SDPA: its output and gradients in the layouts of q, k, v, "
                 "and the fp32 log-sum-exp kept for backward",
}

#: The attention stand-ins' kernels that do the core's matmuls, and their FLOPs as a multiple of
#: the causal forward's (QK^T and PV): backward recomputes QK^T and computes dV, dP, dQ and dK,
#: five matmuls against two (FlashAttention-2, Dao 2023, section 3.1.2).
ATTENTION_FLOP_SHARE = {"attention": 1.0, "attention_backward": 2.5}


def _modeled_kernel(name: str, fn: Callable, linear: bool = False):
    """``fn`` as one fused kernel forward and one backward, as the CUDA kernel it stands for:
    forward, a region reading its tensor arguments and writing its result; backward, a region
    computing the vector-Jacobian product of ``fn`` (at a zero input when ``fn`` is linear in
    its first argument, so that nothing but the other arguments is saved, as TE's fused RoPE
    saves only the frequencies)."""
    import torch

    from megatron_boost.parallel.fusion import observed_call

    def differentiable(args):
        return [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]

    class _Kernel(torch.autograd.Function):
        @staticmethod
        def forward(ctx, n_args, *flat):
            args = flat[:n_args]
            ctx.n_args = n_args
            ctx.grad_of = differentiable(args)
            kept = [a if isinstance(a, torch.Tensor) else None for a in args]
            if linear:
                kept[0] = torch.empty_like(args[0])  # shape only: the vjp of a linear map
            ctx.others = [None if isinstance(a, torch.Tensor) else a for a in args]
            ctx.save_for_backward(*[k for k in kept if k is not None])
            ctx.tensor_pos = [i for i, k in enumerate(kept) if k is not None]
            with torch.no_grad():
                return observed_call(name, fn, *args)

        @staticmethod
        def backward(ctx, grad):
            saved = dict(zip(ctx.tensor_pos, ctx.saved_tensors))
            args = [saved.get(i, ctx.others[i]) for i in range(ctx.n_args)]

            def vjp(*tensors_and_grad):
                *inputs, g = tensors_and_grad
                with torch.enable_grad():
                    live = list(args)
                    for i, t in zip(ctx.grad_of, inputs):
                        live[i] = t.detach().requires_grad_(True)
                    out = fn(*live)
                    grads = torch.autograd.grad(out, [live[i] for i in ctx.grad_of], g)
                # a kernel writes its result into a fresh, dense tensor
                return tuple(t.contiguous() for t in grads)

            grads = observed_call(f"{name}_backward", vjp,
                                  *[args[i] for i in ctx.grad_of], grad)
            full = [None] * ctx.n_args
            for i, g in zip(ctx.grad_of, grads):
                full[i] = g
            return (None, *full)

    def call(*args):
        return _Kernel.apply(len(args), *args)

    return call


def _modeled_attention(sdpa: Callable):
    """torch's SDPA as the flash kernel a GPU runs (FlashAttention-2, cuDNN, TE): one kernel
    forward writing the output in the layout of q (and the fp32 log-sum-exp [b, h, s] it
    keeps), one kernel backward reading q, k, v, the output, the log-sum-exp and the gradient
    and writing dq, dk, dv in the layouts of q, k, v. (The CPU's kernel returns its gradients
    in its own layout, which megatron's [s, b, h, e] views would then copy.)"""
    import functools

    import torch

    from megatron_boost.parallel.fusion import observed_call

    def like(ref, t):  # a kernel allocating its result as its input (empty_like) writes there
        return torch.empty_like(ref).copy_(t)

    class _Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, call):
            out = observed_call("attention", lambda q, k, v: like(q, call(q, k, v)), q, k, v,
                                kind="attention")
            lse = q.new_empty(q.shape[:-1], dtype=torch.float32)  # [b, h, s]
            ctx.call = call
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad):
            def vjp(q, k, v, out, lse, g):
                with torch.enable_grad():
                    live = [t.detach().requires_grad_(True) for t in (q, k, v)]
                    grads = torch.autograd.grad(ctx.call(*live), live, g)
                return tuple(like(ref, t) for ref, t in zip((q, k, v), grads))

            dq, dk, dv = observed_call("attention_backward", vjp, *ctx.saved_tensors, grad,
                                       kind="attention")
            return dq, dk, dv, None

    def call(q, k, v, **kwargs):
        return _Attention.apply(q, k, v, functools.partial(sdpa, **kwargs))

    return call


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

    def eager(fn):  # megatron's jit_fuser'd functions: the function it compiled
        return getattr(fn, "_torchdynamo_orig_callable", None) or getattr(fn, "__wrapped__", fn)

    swiglu, swiglu_back = eager(fused_bias_swiglu.swiglu), eager(fused_bias_swiglu.swiglu_back)
    rope = rope_utils._apply_rotary_pos_emb_bshd
    norm = _modeled_kernel("rms_norm", torch.rms_norm)  # ATen's: F.rms_norm is replaced

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
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in replaced]
    try:
        for owner, name, fn in replaced:
            setattr(owner, name, fn)
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)
