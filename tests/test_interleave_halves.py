"""Two halves of the micro-batch interleaved through a boost decoder layer
(``parallel.interleave_halves``, parallel/interleave.py, docs/design.md §7).

One spawn of two gloo ranks (TP=2, CPU mode, fp32). Each rank builds one boost decoder layer the
way the model builds it and runs the same micro-batch of 4 sequences with the halves off and on
(and both again under low-rank recompute). Checked:

* the interleaved layer equals the whole-batch one: output, input gradient and every
  weight-gradient shard;
* the halves hand over at every forward all-reduce: the products' all-reduces are issued
  alternately by half 0 and half 1 (negative control: with ``hand_over`` a no-op they are not);
* in the backward, each half's dP all-reduce is started by its B side and waited for by its A
  side only after the other half's B side of the same group has run (negative control: a B side
  that waits at once is caught).

Tolerance (fp32): relative 1e-5 of the largest magnitude, the layer tests' bound (docs/design.md
§11). The halves run every GEMM on half the rows (the same per-row sums) and sum the weight
gradients half by half, and the backward reduces dP after σ' instead of dz before it (σ' is
linear in dz: the same sum, another rounding): fp32 rounding, ~sqrt(K)·2^-24 ≈ 1e-6; a half
fed the other's rows, or a gradient reduced twice or not at all, is of order 1.
"""

from __future__ import annotations

import pytest

from tests.rank_pool import distributed
from tests.test_reference_layer import SEED, S, TOL, _rel_err, _transformer_config

B = 4  # sequences: two halves of two (the model, S and SEED: the reference layer test's)


def _run(layer, x, grad, halves: bool, recompute: bool):
    """(output, dx, {parameter: gradient}) of one forward/backward."""
    layer.config.interleave_halves, layer.config.lowrank_recompute = halves, recompute
    layer.zero_grad()
    x = x.clone().requires_grad_(True)
    out = layer(x)[0]
    out.backward(grad)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _errors(ours, theirs) -> dict:
    errs = {"out": _rel_err(ours[0], theirs[0]), "dx": _rel_err(ours[1], theirs[1])}
    errs.update({f"d{n}": _rel_err(g, theirs[2][n]) for n, g in ours[2].items()})
    return errs


def _forward_issuers(layer, x, grad, group):
    """Which half (0/1) issued each forward products all-reduce on ``group``."""
    from unittest import mock

    import torch
    from greenlet import getcurrent

    seen, issuers, real = {}, [], torch.distributed.all_reduce

    def logged(tensor, *args, **kwargs):
        if torch.is_grad_enabled() or not getattr(getcurrent(), "is_half", False):
            return real(tensor, *args, **kwargs)
        issuers.append(seen.setdefault(id(getcurrent()), len(seen)))
        return real(tensor, *args, **kwargs)

    with mock.patch.object(torch.distributed, "all_reduce", logged):
        _run(layer, x, grad, halves=True, recompute=False)
    return issuers


def _worker(rank, world):
    from unittest import mock

    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_boost.measure.layer_comm import build_decoder_layer
    from megatron_boost.parallel import interleave

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group()
    config = _transformer_config()
    model_parallel_cuda_manual_seed(SEED)
    torch.manual_seed(SEED + rank)
    layer = build_decoder_layer(config)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(1.0 if p.dim() == 1 else 0.0, 0.2)
    g = torch.Generator().manual_seed(SEED + rank)
    x = torch.randn(S, B, config.hidden_size // world, generator=g)
    grad = torch.randn(S, B, config.hidden_size // world, generator=g)
    result = {}
    for recompute in (False, True):
        whole = _run(layer, x, grad, halves=False, recompute=recompute)
        result[("match", recompute)] = _errors(_run(layer, x, grad, True, recompute), whole)
    result["issuers"] = _forward_issuers(layer, x, grad, group)
    with mock.patch.object(interleave, "hand_over", lambda: None), \
            mock.patch("megatron_boost.parallel.bottleneck.hand_over", lambda: None):
        result["issuers without hand-over"] = _forward_issuers(layer, x, grad, group)
    return result


@pytest.fixture(scope="module")
def results():
    return distributed(_worker, 2)


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "lowrank-recompute"])
def test_the_interleaved_halves_equal_the_whole_batch(results, recompute):
    for rank, res in enumerate(results):
        errs = res[("match", recompute)]
        assert len(errs) == 2 + 10, errs  # out, dx, A and B x4, the γ of qkv and fc1
        bad = {n: e for n, e in errs.items() if e > TOL}
        assert not bad, f"rank {rank}: {bad}"


def test_the_halves_hand_over_at_every_forward_all_reduce(results):
    """qkv, proj, fc1, fc2: four products all-reduces per half, issued alternately."""
    for res in results:
        assert res["issuers"] == [0, 1] * 4, res["issuers"]


def test_without_the_hand_over_the_halves_run_one_after_the_other(results):
    """Negative control of the test above."""
    for res in results:
        assert res["issuers without hand-over"] == [0] * 4 + [1] * 4, res


@pytest.mark.parametrize("s", [1, 3])
def test_the_join_hands_each_half_a_gradient_of_its_own(s):
    """The A side may accumulate into what the join hands a half (``join_halves``), so it is
    a fresh contiguous tensor, never the caller's gradient: at s = 1 a half's rows of it are
    contiguous already, and ``contiguous()`` would hand out the caller's memory (negative
    control: the test fails there with it)."""
    import torch

    from megatron_boost.parallel.interleave import join_halves

    halves = [torch.randn(s, 2, 5, requires_grad=True) * 1 for _ in range(2)]  # non-leaves
    received = [None, None]
    for i, h in enumerate(halves):  # a non-leaf's hook sees the very gradient the join returns
        h.register_hook(lambda g, i=i: received.__setitem__(i, g))
    grad = torch.randn(s, 4, 5)
    caller = grad.untyped_storage().data_ptr(), grad.untyped_storage().nbytes()
    join_halves(halves).backward(grad)
    for i, g in enumerate(received):
        assert g.is_contiguous()
        start = g.untyped_storage().data_ptr()
        assert not caller[0] <= start < caller[0] + caller[1], f"half {i} got the caller's memory"
        assert torch.equal(g, grad.chunk(2, dim=1)[i])
