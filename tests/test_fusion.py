"""The fused regions (megatron_boost/parallel/fusion.py, docs/design.md §17): each is ONE
kernel once compiled, which is how the op ledger counts it, and compiles to what it computes
eagerly.

On CUDA megatron's jit_fuser (torch.compile) compiles them with Triton; here torch's inductor
compiles them for the CPU, whose scheduler makes the same fusion decisions for these shapes of
work (pointwise operations and one reduction over the last or the first dimension): each
region's generated ``call`` launches one kernel. That a GPU run does the same is for the GPU
check to confirm (docs/gpu.md). Every region defined must have a case here.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from megatron_boost.config.transformer import get_bottleneck_activation_grad
from megatron_boost.model import blocks  # noqa: F401  (defines the MLP's regions)
from megatron_boost.parallel import online_rmsnorm  # noqa: F401  (defines the norm's regions)
from megatron_boost.parallel.fusion import REGIONS

pytestmark = pytest.mark.compat  # the tiers: docs/testing.md

S, B, R, D = 8, 4, 48, 32


def _cases():
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype)

    silu, silu_grad = F.silu, get_bottleneck_activation_grad("silu")
    products, dz = rand(S, B, R), rand(S, B, R)
    sumsq = torch.rand(S, B, 1, generator=g) * R + 1.0  # fp32, positive
    a, gamma, x = rand(R, D), rand(D), rand(S, B, D)
    return {
        "sum_of_squares": (x,),
        "_scaled_weight": (a, gamma),
        "_scaled_weight_backward": (rand(R, D), a, gamma),
        "_accumulate_scaled_weight_backward": (torch.zeros(R, D), rand(R, D), a, gamma),
        "scale_and_activate": (products, sumsq, D * 4, 1e-6, silu),
        "scale_and_activate_backward": (products, sumsq, dz, D * 4, 1e-6, silu_grad),
        "activate": (products, silu),
        "activate_backward": (products, dz, silu_grad),
        "_gated": (products, rand(S, B, R), silu),
        "_gated_backward": (dz, products, rand(S, B, R), silu, silu_grad),
    }


def test_every_region_has_a_case():
    assert set(REGIONS) == set(_cases())


@pytest.mark.parametrize("name", sorted(_cases()))
def test_a_region_compiles_to_one_kernel_computing_the_same(name):
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    args = _cases()[name]
    torch._dynamo.reset()
    # compile in this process: no pool of compile workers left behind
    with inductor_config.patch(compile_threads=1):
        compiled = torch.compile(REGIONS[name].eager, fullgraph=True, dynamic=False)
        result, (code, *_) = run_and_get_code(compiled, *args)
    call = code[code.index("def call("):]
    kernels = re.findall(r"\b(cpp_fused_\w+|extern_kernels\.\w+)\(", call)
    assert len(kernels) == 1, kernels
    eager = REGIONS[name].eager(*args)
    for got, want in zip(*(t if isinstance(t, tuple) else (t,) for t in (result, eager))):
        # bf16 results: the compiled kernel keeps intermediates in fp32 where eager rounds
        # each operation to bf16, a few bf16 ulps (2^-8 relative each) apart at most
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("sigma", ["silu", "gelu", "relu", "identity"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_norms_backward_region_is_autograds_arithmetic(sigma, dtype):
    """Eagerly (the CPU's path) the σ and scale region and its backward give bitwise what
    autograd gives through the same expression, which the layers ran before: the scale
    ``round(P · rsqrt(Σx²/d + ε))`` then σ (docs/design.md §3, §11)."""
    from megatron_boost.config.transformer import get_bottleneck_activation

    act, act_grad = get_bottleneck_activation(sigma), get_bottleneck_activation_grad(sigma)
    g = torch.Generator().manual_seed(0)
    products = torch.randn(S, B, R, generator=g).to(dtype).requires_grad_()
    sumsq = (torch.rand(S, B, 1, generator=g) * R + 1).requires_grad_()
    dz = torch.randn(S, B, R, generator=g).to(dtype)
    inv = online_rmsnorm.inverse_rms(sumsq, 4 * D, 1e-6)
    z = act((products.float() * inv).to(dtype))  # the expression, under autograd
    z.backward(dz)
    region = REGIONS["scale_and_activate"]
    assert torch.equal(region(products.detach(), sumsq.detach(), 4 * D, 1e-6, act), z)
    d_products, d_sumsq = REGIONS["scale_and_activate_backward"](
        products.detach(), sumsq.detach(), dz, 4 * D, 1e-6, act_grad)
    assert torch.equal(d_products, products.grad) and torch.equal(d_sumsq, sumsq.grad)


@pytest.mark.parametrize("silu_gate", [True, False])
def test_the_mlp_products_backward_region_is_autograds_arithmetic(silu_gate):
    from megatron_boost.model.blocks import gated_product

    g = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(S, B, R, generator=g).to(torch.bfloat16).requires_grad_()
                for _ in range(2))
    grad = torch.randn(S, B, R, generator=g).to(torch.bfloat16)
    ((F.silu(gate) if silu_gate else gate) * up).backward(grad)
    want = (gate.grad, up.grad)
    gate.grad = up.grad = None
    gated_product(gate, up, silu_gate).backward(grad)
    assert torch.equal(gate.grad, want[0]) and torch.equal(up.grad, want[1])
