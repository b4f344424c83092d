"""The factors' weight gradients accumulate in their GEMM (parallel/wgrad.py, docs/design.md §7):
megatron's ``gradient_accumulation_fusion`` contract (``main_grad``, ``grad_added_to_main_grad``)
for every bottleneck factor, naive and boost (and boost's group pipeline).

The DDP-wrapped model (megatron's DDP gives each parameter its ``main_grad``) runs two
micro-batches, with the fusion on and off (``bottleneck_grad_accumulation_fusion``): the losses
are bitwise equal (the forward is unchanged), the accumulated gradients equal to fp32 rounding
(with the fusion the GEMM adds into main_grad, beta = 1; without, the GEMM's result is added by
DDP's hook: one rounding apart, relative 1e-6 of the largest magnitude at these sizes), and with
the fusion DDP's hook adds nothing into a factor's main_grad (no ``add_`` into it is dispatched)
while each factor says ``grad_added_to_main_grad``.
"""

from __future__ import annotations

import pytest
import torch

from tests.rank_pool import distributed
from tests.test_lowrank_recompute import MICRO_BATCH, MODEL, SEQ, _built

CASES = (("naive", 1), ("boost", 1), ("boost", 2))
TP, TOL = 2, 1e-6


class _AddsInto(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the in-place adds dispatched into any of the given tensors' memory."""

    def __init__(self, targets):
        super().__init__()
        self.ptrs = {t.data_ptr() for t in targets}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.add_ and args[0].data_ptr() in self.ptrs:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _two_micro_batches(built, spec, fused: bool):
    """(losses, {name: main_grad}, adds into the factors' main_grad, factors flagged)."""
    from megatron_boost.testing.verification import layout_batches

    model = built.chunks[0]
    model.zero_grad_buffer()
    for module in model.modules():  # the layers read it from their config at each call
        if getattr(module, "config", None) is not None:
            module.config.bottleneck_grad_accumulation_fusion = fused
    factors = {n: p for n, p in model.named_parameters() if n.endswith((".A", ".B"))}
    losses, adds = [], _AddsInto([p.main_grad for p in factors.values()])
    for i, batch in enumerate(layout_batches(spec, 100, 2, 0)):
        sync = model.no_sync() if i == 0 else torch.enable_grad()
        with sync:
            loss = model(batch["tokens"], batch["position_ids"], None,
                         labels=batch["labels"]).float().mean()
            with adds:
                loss.backward()
        losses.append(loss.detach())
    model.finish_grad_sync()
    flagged = all(p.grad_added_to_main_grad for p in factors.values())
    grads = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    return losses, grads, adds.count, flagged, len(factors)


def _run(rank, world):
    from megatron.core import parallel_state

    from megatron_boost.config.layout import Layout
    from megatron_boost.testing.verification import LayoutSpec
    from megatron_boost.train.step import initialize_parallel

    out = {}
    for mode, chunks in CASES:
        spec = LayoutSpec(layout=Layout(mode=mode, tp=TP), model=MODEL, seq_length=SEQ,
                          micro_batch_size=MICRO_BATCH)
        initialize_parallel(TP, 1, None, spec.seed)
        built = _built(spec, **({"parallel.bottleneck_overlap_chunks": chunks}
                                if chunks > 1 else {}))
        for fused in (False, True):
            out[(mode, chunks, fused)] = _two_micro_batches(built, spec, fused)
        parallel_state.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    return distributed(_run, TP)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("mode,chunks", CASES)
def test_fused_accumulation_gives_the_same_training(results, mode, chunks):
    for rank, res in enumerate(results):
        off_losses, off_grads, _, _, _ = res[(mode, chunks, False)]
        on_losses, on_grads, _, _, _ = res[(mode, chunks, True)]
        assert all(torch.equal(a, b) for a, b in zip(on_losses, off_losses)), rank
        errs = {n: _rel(on_grads[n], g) for n, g in off_grads.items()}
        assert max(errs.values()) <= TOL, f"rank {rank}: {errs}"


@pytest.mark.parametrize("mode,chunks", CASES)
def test_ddp_adds_nothing_for_the_factors(results, mode, chunks):
    """With the fusion no add_ reaches a factor's main_grad and every factor is flagged; without
    it DDP's hook adds each factor's gradient, once per micro-batch."""
    for rank, res in enumerate(results):
        _, _, off_adds, off_flagged, factors = res[(mode, chunks, False)]
        _, _, on_adds, on_flagged, _ = res[(mode, chunks, True)]
        assert factors > 0 and off_adds == 2 * factors and not off_flagged, rank
        assert on_adds == 0 and on_flagged, f"rank {rank}: {on_adds} adds"


def test_the_accumulation_falls_back_where_torch_has_no_gemm_for_it():
    """fp32 operands into an fp32 main_grad: one GEMM with beta = 1 (dst += a·b); bf16 operands
    into an fp32 main_grad on the CPU (torch has no out_dtype GEMM there): no target, the
    gradient goes through DDP's hook; the fusion off, or no main_grad: no target."""
    from megatron_boost.parallel.wgrad import accumulation_target, gemm_into

    param = torch.nn.Parameter(torch.zeros(3, 4))
    assert accumulation_target(param, True, torch.float32) is None  # no main_grad: not DDP's
    param.main_grad = torch.ones(3, 4)
    assert accumulation_target(param, True, torch.float32) is param.main_grad
    assert accumulation_target(param, False, torch.float32) is None
    assert accumulation_target(param, True, torch.bfloat16) is None
    a, b = torch.randn(3, 5), torch.randn(5, 4)
    gemm_into(param.main_grad, a, b, accumulate=True)
    assert torch.allclose(param.main_grad, 1 + a @ b, rtol=1e-6, atol=1e-6)


def test_a_fake_tensor_mode_does_not_decide_the_device_probe():
    """The op ledger runs the layers under a fake-tensor mode, which accepts any call: the
    mixed-dtype GEMM probe made there must still ask the device, or a later real bf16 run on
    the CPU would be told the GEMM exists (the answer is cached) and fail in backward."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_boost.parallel import wgrad

    wgrad._probe.cache_clear()
    try:
        with FakeTensorMode():
            wgrad._mixed_dtype_addmm("cpu", torch.bfloat16, torch.float32)
        assert wgrad._mixed_dtype_addmm("cpu", torch.bfloat16, torch.float32) is False
        with wgrad.mixed_dtype_gemm_assumed(True):  # the ledger's CUDA model says
            assert wgrad._mixed_dtype_addmm("cpu", torch.bfloat16, torch.float32) is True
    finally:
        wgrad._probe.cache_clear()
