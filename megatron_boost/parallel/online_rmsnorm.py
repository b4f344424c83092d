"""online-RMSNorm's arithmetic (docs/design.md §3) as fused regions (``parallel/fusion.py``):
one kernel each on CUDA, the exact RMSNorm of the whole hidden vector although each TP rank
holds only its slice of it.

boost's column layers fuse the pre-norm into their A GEMM,

    A·(γ ⊙ x / rms(x)) = ((A ⊙ γ)·x) / rms(x),     rms(x) = sqrt(Σ_k x_k² / d + ε)

so each rank needs the product of its slice with the γ-scaled factor (a weight-sized scaling,
:func:`fold_norm_weight`, in place of a token-sized γ ⊙ x) and its share of the statistic Σx²,
summed over the TP group by the products' all-reduce (``parallel/bottleneck.py``). The statistic
is fp32 from x to 1/rms in every dtype. The regions:

* :func:`sum_of_squares`: Σ_k x_k² of the local slice, fp32 [s, b, 1] (one read of x);
* :func:`scale_and_activate`: z = σ(round(P · rsqrt(Σx²/d + ε))) from the reduced products P and
  statistic, the same arithmetic as ``F.rms_norm``'s fp32 scaling followed by σ; nothing is
  saved but P and Σx² (σ and the scaling are recomputed in backward, one more read of P);
* :func:`scale_and_activate_backward`: dP and dΣx² from P, Σx² and dz, in one pass: the
  gradient autograd computes through the same operations, in the same order;
* :func:`activate` / :func:`activate_backward`: σ alone, for the groups without a norm.

σ' is the activation's registered gradient (``config/transformer.py``); an activation
registered without one is differentiated by autograd, outside the regions.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from megatron_boost.parallel.fusion import fused_region

__all__ = ["statistic_rides_with_products", "inverse_rms", "sum_of_squares",
           "fold_norm_weight", "scale_and_activate", "scale_and_activate_backward", "activate",
           "activate_backward"]


def statistic_rides_with_products(dtype: torch.dtype) -> bool:
    """Whether the fp32 sum of squares travels as the extra column of the products' all-reduce
    (one Σr + 1 collective): with fp32 products. With bf16 products it is all-reduced in fp32
    on its own, since a bf16 sum of squares carries a 2^-9 relative error that RMSNorm's own
    fp32 statistic does not."""
    return dtype == torch.float32


def inverse_rms(sumsq: torch.Tensor, hidden_size: int, eps: float) -> torch.Tensor:
    """1/rms = rsqrt(Σx²/d + ε), fp32 [s, b, 1], from the complete statistic."""
    return torch.rsqrt(sumsq / hidden_size + eps)


@fused_region
def sum_of_squares(x: torch.Tensor) -> torch.Tensor:
    """Σ_k x_k² over the last dimension in fp32: [s, b, d/t] -> [s, b, 1]."""
    return x.float().pow(2).sum(dim=-1, keepdim=True)


@fused_region
def _scaled_weight(a: torch.Tensor, gamma: torch.Tensor) -> torch.Tensor:
    return a * gamma  # [Σr, d/t] ⊙ [d/t]: γ broadcast over the rows


@fused_region
def _scaled_weight_backward(grad: torch.Tensor, a: torch.Tensor, gamma: torch.Tensor
                            ) -> Tuple[torch.Tensor, torch.Tensor]:
    # d(A ⊙ γ)/dA = γ, d/dγ = Σ_rows A (fp32 accumulation, as torch's sum of a bf16 tensor)
    return grad * gamma, (grad.float() * a.float()).sum(dim=0).to(gamma.dtype)


@fused_region
def _accumulate_scaled_weight_backward(main_grad: torch.Tensor, grad: torch.Tensor,
                                       a: torch.Tensor, gamma: torch.Tensor
                                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """A.main_grad += dW ⊙ γ in place and dγ = Σ_rows dW ⊙ A, in ONE pass over dW (the
    gradient accumulation fusion's form of :func:`_scaled_weight_backward`). Returns
    (main_grad, dγ): the accumulator too, so that what the kernel writes is its result."""
    main_grad.addcmul_(grad, gamma)
    return main_grad, (grad.float() * a.float()).sum(dim=0).to(gamma.dtype)


class _FoldNormWeight(torch.autograd.Function):
    """W = A ⊙ γ: the norm's weight folded into the A factor ([Σr, d/t], weight-sized).
    fwd: one kernel; bwd: dA = dW ⊙ γ and dγ = Σ_rows dW ⊙ A in one kernel, or, with the
    gradient accumulation fusion (``parallel/wgrad.py``), A.main_grad += dW ⊙ γ in place (no
    dA tensor, nothing for DDP's hook to add) and dγ in the same kernel."""

    @staticmethod
    def forward(ctx, a, gamma, fuse_wgrad: bool):
        ctx.save_for_backward(a, gamma)
        ctx.main_grad = getattr(a, "main_grad", None) if fuse_wgrad else None
        return _scaled_weight(a, gamma)

    @staticmethod
    def backward(ctx, grad):
        from megatron_boost.parallel.wgrad import dummy_gradient

        a, gamma = ctx.saved_tensors
        if ctx.main_grad is None:
            return (*_scaled_weight_backward(grad, a, gamma), None)
        _, d_gamma = _accumulate_scaled_weight_backward(ctx.main_grad, grad, a, gamma)
        return dummy_gradient(a), d_gamma, None


def fold_norm_weight(a: torch.Tensor, gamma: torch.Tensor, fuse_wgrad: bool = False
                     ) -> torch.Tensor:
    """A ⊙ γ ([Σr, d/t]): the GEMM of x with it equals A·(γ ⊙ x), without the token-sized
    γ ⊙ x (docs/design.md §3). ``fuse_wgrad``: dA accumulates in A's main_grad."""
    return _FoldNormWeight.apply(a, gamma, fuse_wgrad)


@fused_region
def scale_and_activate(products: torch.Tensor, sumsq: torch.Tensor, hidden_size: int,
                       eps: float, act: Callable) -> torch.Tensor:
    """z = σ(P / rms): the reduced products [s, b, Σr] scaled in fp32 by 1/rms (computed from the
    complete fp32 statistic [s, b, 1]) and rounded once to P's dtype, then σ."""
    scaled = (products.float() * inverse_rms(sumsq, hidden_size, eps)).to(products.dtype)
    return act(scaled)


@fused_region
def scale_and_activate_backward(products: torch.Tensor, sumsq: torch.Tensor, dz: torch.Tensor,
                                hidden_size: int, eps: float, act_grad: Callable
                                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(dP, dΣx²) of :func:`scale_and_activate` from dz: the operations autograd runs
    through it (σ', the fp32 scale, rsqrt, the division by d), in its order."""
    inv = inverse_rms(sumsq, hidden_size, eps)  # fp32 [s, b, 1]
    p32 = products.float()
    scaled = (p32 * inv).to(products.dtype)
    dy = act_grad(dz, scaled).float()  # dL/d(scaled), through the rounding cast
    d_products = (dy * inv).to(products.dtype)
    d_inv = (dy * p32).sum(dim=-1, keepdim=True)  # [s, b, 1]
    d_sumsq = (-0.5 * d_inv * inv.pow(3)) / hidden_size  # rsqrt', then / d
    return d_products, d_sumsq


@fused_region
def activate(products: torch.Tensor, act: Callable) -> torch.Tensor:
    """z = σ(P) (the groups without a norm)."""
    return act(products)


@fused_region
def activate_backward(products: torch.Tensor, dz: torch.Tensor, act_grad: Callable
                      ) -> torch.Tensor:
    """dP = σ'(P)·dz."""
    return act_grad(dz, products)


def autograd_activation_grad(act: Callable) -> Callable:
    """σ'(y)·dz by autograd, for an activation registered without its gradient."""
    def grad(dz: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            y = y.detach().requires_grad_(True)
            return torch.autograd.grad(act(y), y, dz)[0]
    return grad


def bottleneck_input(products: torch.Tensor, sumsq: Optional[torch.Tensor], hidden_size: int,
                     eps: float, act: Callable, identity: bool) -> torch.Tensor:
    """z, the B factors' input: σ of the (scaled, when ``sumsq`` is given) products; the
    products themselves for an identity σ without a norm (no kernel)."""
    if sumsq is not None:
        return scale_and_activate(products, sumsq, hidden_size, eps, act)
    return products if identity else activate(products, act)


def bottleneck_input_backward(products: torch.Tensor, sumsq: Optional[torch.Tensor],
                              dz: torch.Tensor, hidden_size: int, eps: float,
                              act_grad: Callable, identity: bool
                              ) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(dP, dΣx² or None) of :func:`bottleneck_input`."""
    if sumsq is not None:
        return scale_and_activate_backward(products, sumsq, dz, hidden_size, eps, act_grad)
    return (dz if identity else activate_backward(products, dz, act_grad)), None
