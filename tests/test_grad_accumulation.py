"""DDP's gradient accumulation in the op ledger (megatron_boost/measure/grad_accumulation.py,
docs/design.md §17): counted in every mode, from whether the layer's parameters say their
gradient is already in ``main_grad``. Negative control: full rank without megatron's
gradient-accumulation fusion adds every weight's gradient through DDP's hook."""

from __future__ import annotations

import pytest

from megatron_boost.measure.ledger import LedgerSpec, ledger_in_process
from megatron_boost.config.layout import Layout
from megatron_boost.config.shape import ModelShape

pytestmark = pytest.mark.fast

SMALL = ModelShape("small", num_layers=2, hidden=64, ffn=96, heads=4, query_groups=2,
                   vocab=256, seq_length=32, attn_rank=16, mlp_rank=24)


def _measured(mode):
    from megatron_boost.runtime.cpu_mode import cpu_mode_left_as_found, use_cpu

    with cpu_mode_left_as_found():
        use_cpu(force=True)
        return ledger_in_process(LedgerSpec(shape=SMALL, layout=Layout(mode=mode, tp=2),
                                            seq_length=32))


def _local_params(mode):
    """{name: elements} of one layer's parameters on one rank, as the ledger builds it."""
    from megatron_boost.measure import ledger as ledger_module
    from megatron_boost.runtime.cpu_mode import cpu_mode_left_as_found, use_cpu
    from torch._subclasses.fake_tensor import FakeTensorMode

    spec = LedgerSpec(shape=SMALL, layout=Layout(mode=mode, tp=2), seq_length=32)
    with cpu_mode_left_as_found():
        use_cpu(force=True)
        with ledger_module._fake_tp_group(2), FakeTensorMode(allow_non_fake_inputs=True):
            from megatron_boost.measure.kernel_models import cuda_kernel_models

            with cuda_kernel_models():
                layer = ledger_module._build(spec)[0]
            return {name: p.numel() for name, p in layer.named_parameters() if p.requires_grad}


def _is_factor(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ("A", "B")


@pytest.mark.parametrize("mode", ["boost", "naive"])
def test_the_bottleneck_factors_accumulate_in_their_gemms(mode):
    """The bottleneck factors keep megatron's gradient_accumulation_fusion contract
    (parallel/wgrad.py): their weight-gradient GEMMs add into main_grad and set
    grad_added_to_main_grad, so DDP's hook adds only the other parameters (the norms'
    weights): one kernel each, reading main_grad and the bf16 gradient, writing main_grad.
    Fails when a factor's gradient goes through the hook again (4 factors more per group)."""
    ledger = _measured(mode)
    params = _local_params(mode)
    others = {n: e for n, e in params.items() if not _is_factor(n)}
    assert len(others) < len(params)  # the layer has factors
    adds = ledger.ddp_accumulation()
    assert len(adds) == len(others)
    assert sum(k.bytes for k in adds) == sum(others.values()) * (4 + 2 + 4)
    assert all(k.phase == "bwd" and k.kind == "elementwise" for k in adds)


def test_full_rank_accumulates_in_its_weight_gradient_gemms(monkeypatch):
    """Megatron's linears with gradient_accumulation_fusion add into main_grad in their wgrad
    GEMM and set grad_added_to_main_grad: DDP's hook adds only the norms' weights. Without
    the fusion (negative control) it adds every weight's gradient."""
    from megatron_boost.measure import ledger as ledger_module

    fused = _measured("full")
    assert len(fused.ddp_accumulation()) == 2  # the two RMSNorm weights
    accumulating = [k for k in fused.kernels if k.name.startswith("aten.addmm_")]
    assert len(accumulating) == 4  # qkv, proj, fc1, fc2

    plain = ledger_module._cuda_fusions

    def without_fusion(spec):
        return tuple((n, False if n == "gradient_accumulation_fusion" else on, why)
                     for n, on, why in plain(spec))

    monkeypatch.setattr(ledger_module, "_cuda_fusions", without_fusion)
    unfused = _measured("full")
    assert len(unfused.ddp_accumulation()) == 6
    assert not [k for k in unfused.kernels if k.name.startswith("aten.addmm_")]


class _Scopes:
    backward_scope = "layer"


def _contract_linear(accumulate: bool):
    """A linear layer's autograd function: with ``accumulate``, megatron's
    gradient_accumulation_fusion contract (the weight gradient added into ``main_grad`` in
    place, ``grad_added_to_main_grad`` set on the saved weight, a dummy gradient returned)."""
    import torch

    class Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            ctx.main_grad = getattr(w, "main_grad", None)  # as megatron's linear keeps it
            return x @ w.t()

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            if not accumulate:
                return g @ w, g.t() @ x
            w.main_grad = ctx.main_grad
            w.main_grad.add_(g.t() @ x)
            w.grad_added_to_main_grad = True
            return g @ w, torch.full_like(w, float("nan"))  # a dummy: its values are garbage

    return Linear


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("saved_tensor_hooks", [False, True])
def test_ddps_rule_adds_a_gradient_once(accumulate, saved_tensor_hooks):
    """On real tensors: main_grad ends as the weight gradient exactly once, whether the layer
    adds it itself (and says so, on the tensor ctx.saved_tensors hands it: under the ledger's
    saved-tensor hooks another object than the parameter) or DDP's hook does. Negative
    control: without the guard, the self-accumulating layer's gradient is added twice (or its
    dummy added)."""
    import contextlib

    import torch

    from megatron_boost.measure.grad_accumulation import ddp_grad_accumulation
    from megatron_boost.measure.memory import SavedActivations

    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3, bias=False)
    x = torch.randn(5, 4)
    expected = (torch.ones(5, 3).t() @ x)
    with ddp_grad_accumulation(layer, _Scopes()):
        saved = SavedActivations() if saved_tensor_hooks else contextlib.nullcontext()
        with saved:
            out = _contract_linear(accumulate).apply(x, layer.weight)
        out.sum().backward()
        assert torch.equal(layer.weight.main_grad, expected)
        assert layer.weight.grad is None
