"""boost's group pipeline (``parallel.bottleneck_overlap_chunks`` > 1, parallel/pipeline.py,
docs/design.md §7): the overlapped layer equals the synchronous one, composes with low-rank
recompute, and the op ledger sees each all-reduce beside more GEMMs than the synchronous layer
gives it.

Tolerance (fp32): the outputs and the input gradient are computed row by row by the same
arithmetic in either layer, so they must be bitwise equal; the weight gradients (sums over the
tokens) are accumulated block by block in their GEMMs, another summation order: relative 1e-6
of the largest magnitude (fp32 rounding ~sqrt(T)·2^-24 ≈ 1e-6 at most over T = 16 tokens; a
wrong block is O(1)).
"""

from __future__ import annotations

import pytest
import torch

from tests.rank_pool import distributed
from tests.test_layers import B, D, FFN, HEADS, HN, S, build_layer, make_config, rel_err

KINDS = ("qkv_gqa", "fc1", "proj", "fc2")
TP, CHUNKS = 2, 3
WEIGHT_TOL = 1e-6


def _weights(layer):
    """Identical global weights (and a non-trivial γ) for every build of a kind."""
    from megatron_boost.testing.layers import global_shapes, load_global_weights

    g = torch.Generator().manual_seed(7)
    weights = {n: torch.randn(shape, generator=g) * 0.3
               for n, shape in global_shapes(layer).items()}
    if "layer_norm_weight" in weights:
        weights["layer_norm_weight"] = 1.0 + 0.2 * torch.randn(D, generator=g)
    load_global_weights(layer, {n: w.to(layer.A.dtype) for n, w in weights.items()})


def _run(kind, chunks, group, k, dtype=torch.float32, recompute=False):
    """One forward and backward of a boost layer on this rank's shard: its outputs, input
    gradient, weight gradients and collectives (count and bytes per direction)."""
    from megatron_boost.measure.collectives import record_collectives
    from megatron_boost.parallel.recompute import lowrank_checkpoint

    layer = build_layer(kind, "boost", make_config(TP, "boost", "silu",
                                                   4 if kind == "qkv_gqa" else HEADS,
                                                   dtype, chunks), group)
    _weights(layer)
    g = torch.Generator().manual_seed(11 + k)
    x = torch.randn(S, B, {"proj": HEADS * HN, "fc2": FFN}.get(kind, D) // TP,
                    generator=g).to(dtype).requires_grad_(True)

    def run(h):  # one tensor for the checkpoint: the projections side by side
        y, _ = layer(h)
        return torch.cat(y, dim=-1) if isinstance(y, tuple) else y

    with record_collectives(group) as log:
        y = lowrank_checkpoint(run, x) if recompute else run(x)
        y.backward(torch.randn(y.shape, generator=g).to(dtype))
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return {"y": y.detach(), "dx": x.grad, "grads": grads, "comm": log.summary()}


def _cases(rank, world):
    import torch.distributed as dist

    group = dist.new_group([0, 1])
    out = {}
    for kind in KINDS:
        out[(kind, 1)] = _run(kind, 1, group, rank)
        out[(kind, CHUNKS)] = _run(kind, CHUNKS, group, rank)
        out[(kind, CHUNKS, "lowrank")] = _run(kind, CHUNKS, group, rank, recompute=True)
    for dtype in (torch.bfloat16,):  # the statistic's own fp32 all-reduce, recorded apart
        out[("fc1", CHUNKS, dtype)] = _run("fc1", CHUNKS, group, rank, dtype)
        out[("fc1", CHUNKS, dtype, "lowrank")] = _run("fc1", CHUNKS, group, rank, dtype,
                                                      recompute=True)
    return out


@pytest.fixture(scope="module")
def results():
    return distributed(_cases, TP)


@pytest.mark.parametrize("kind", KINDS)
def test_overlapped_equals_synchronous_fp32(results, kind):
    """Outputs and input gradient bitwise; weight gradients to 1e-6 (module docstring); the
    same bytes in CHUNKS times the all-reduces, forward and backward."""
    for rank, res in enumerate(results):
        one, piped = res[(kind, 1)], res[(kind, CHUNKS)]
        assert torch.equal(piped["y"], one["y"]), f"rank {rank}: outputs differ"
        assert torch.equal(piped["dx"], one["dx"]), f"rank {rank}: input gradients differ"
        errs = {n: rel_err(piped["grads"][n], g) for n, g in one["grads"].items()}
        assert max(errs.values()) <= WEIGHT_TOL, f"rank {rank}: {errs}"
        for phase in ("fwd", "bwd"):
            assert piped["comm"][phase]["bytes"] == one["comm"][phase]["bytes"]
            assert piped["comm"][phase]["count"] == CHUNKS * one["comm"][phase]["count"]


@pytest.mark.parametrize("kind", KINDS)
def test_lowrank_recompute_of_the_pipeline_is_bitwise_and_adds_no_collective(results, kind):
    """The checkpointed pipeline records its reduced buffer once complete and the recompute
    replays it (σ and B GEMMs only): gradients bitwise, no collective re-run."""
    keys = [((kind, CHUNKS), (kind, CHUNKS, "lowrank"))]
    if kind == "fc1":
        keys.append((("fc1", CHUNKS, torch.bfloat16), ("fc1", CHUNKS, torch.bfloat16, "lowrank")))
    for rank, res in enumerate(results):
        for plain_key, ckpt_key in keys:
            plain, ckpt = res[plain_key], res[ckpt_key]
            assert torch.equal(ckpt["dx"], plain["dx"]), f"rank {rank} {ckpt_key}"
            for name, grad in plain["grads"].items():
                assert torch.equal(ckpt["grads"][name], grad), f"rank {rank} {ckpt_key} {name}"
            assert ckpt["comm"] == plain["comm"], f"rank {rank} {ckpt_key}"


def test_the_ledger_sees_each_all_reduce_beside_more_gemms():
    """The op ledger (fake tensors, the 7B-like small layer at TP 2): with the pipeline no
    forward product all-reduce is exposed (synchronous in the one-block layer), and every
    group's backward all-reduces together have more GEMM FLOPs beside them than the one-block
    layer's (its own dB GEMMs only)."""
    from megatron_boost.config.layout import Layout
    from megatron_boost.measure.ledger import LedgerSpec, layer_ledger
    from tests.test_ledger import SMALL

    def ledger(chunks):
        return layer_ledger(LedgerSpec(shape=SMALL, layout=Layout(mode="boost", tp=2),
                                       seq_length=32, overlap_chunks=chunks))

    one, piped = ledger(1), ledger(2)
    products = [c for c in piped.collectives if c.phase == "fwd" and c.width > 1]
    assert products and not any(c.exposed for c in products)
    assert any(c.exposed for c in one.collectives if c.phase == "fwd")

    def beside(ledger, scope):
        return sum(c.overlap_flops for c in ledger.collectives
                   if c.phase == "bwd" and c.scope == scope)

    scopes = {c.scope for c in one.collectives if c.phase == "bwd"}
    assert len(scopes) == 4
    for scope in scopes:
        assert beside(piped, scope) > beside(one, scope), scope
