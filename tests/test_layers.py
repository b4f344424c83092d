"""Bottleneck layers (naive, boost) against a single-process PyTorch reference.

One spawn of four gloo workers runs every case: TP groups of size 1, 2 and 4 are carved out of
the four ranks, every layer kind × mode × activation is built with identical global weights,
and each rank returns, per case, the worst relative error of its output, its input gradient and
every weight-gradient shard against the matching slice of the reference, plus the collectives
it issued. Negative controls load a deliberately wrong shard and must be caught.

Tolerance (fp32): relative 1e-5 of the reference's largest magnitude. The parallel layers sum
the same products in a different order (split K of the A GEMM, all-reduce order); fp32 rounding
gives ~sqrt(K)·2^-24 ≈ 1e-6 relative at these sizes, so 1e-5 leaves a 10x margin while any
sharding error (a wrong slice, a missing all-reduce) is O(1). bf16: 3e-2 (2^-8 = 4e-3 per
rounding, a few roundings through A, the norm, σ and B).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from tests.rank_pool import distributed
from megatron_boost.testing.layers import (axis_of, global_shapes, load_global_weights, local,
                                           shard_of)

pytestmark = [pytest.mark.fast, pytest.mark.compat]  # the tiers: docs/testing.md

S, B, D, HEADS, FFN, HN = 8, 2, 64, 8, 96, 8
R_ATTN, R_MLP = 16, 24
KINDS = ("qkv_mha", "qkv_gqa", "fc1", "proj", "fc2")
MODES = ("naive", "boost")
ACTS = ("silu", "identity")
TPS = (1, 2, 4)
FP32_TOL, BF16_TOL = 1e-5, 3e-2


def make_config(tp, mode, act="silu", groups=HEADS, dtype=torch.float32, chunks=1):
    from megatron_boost.config.transformer import BoostTransformerConfig

    return BoostTransformerConfig(
        num_layers=1, hidden_size=D, num_attention_heads=HEADS, num_query_groups=groups,
        ffn_hidden_size=FFN, kv_channels=HN, tensor_model_parallel_size=tp,
        tp_mode=mode, attn_rank=R_ATTN, mlp_rank=R_MLP, bottleneck_activation=act,
        add_bias_linear=False, use_cpu_initialization=True, params_dtype=dtype,
        layernorm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0,
        bottleneck_overlap_chunks=chunks)


def build_layer(kind, mode, config, group):
    from megatron_boost.parallel import layers as L

    groups = config.num_query_groups
    qkv_out = HEADS * HN + 2 * groups * HN
    cls = {("boost", "qkv"): L.BoostLinearQKV, ("boost", "fc1"): L.BoostLinearFC1,
           ("boost", "proj"): L.BoostLinearProj, ("boost", "fc2"): L.BoostLinearFC2,
           ("naive", "qkv"): L.NaiveLinearQKV, ("naive", "fc1"): L.NaiveLinearFC1,
           ("naive", "proj"): L.NaiveLinearProj, ("naive", "fc2"): L.NaiveLinearFC2}
    if kind.startswith("qkv"):
        return cls[(mode, "qkv")](D, qkv_out, config=config, tp_group=group,
                                  tp_comm_buffer_name="qkv")
    if kind == "fc1":
        return cls[(mode, "fc1")](D, 2 * FFN, config=config, tp_group=group,
                                  tp_comm_buffer_name="fc1")
    in_size = HEADS * HN if kind == "proj" else FFN
    return cls[(mode, kind)](in_size, D, config=config, tp_group=group,
                              tp_comm_buffer_name=kind)


def reference(kind, act, weights, x):
    """Plain PyTorch B·σ(A·x), with RMSNorm(x) first where the boost layer fuses it: each
    projection's global output [s, b, d_out_p], in the group's order."""
    sigma = {"silu": F.silu, "identity": lambda t: t}[act]
    if "layer_norm_weight" in weights:
        x = F.rms_norm(x, (x.shape[-1],), weights["layer_norm_weight"], eps=1e-5)
    names = {"qkv_mha": ("q", "k", "v"), "qkv_gqa": ("q", "k", "v"), "fc1": ("gate", "up"),
             "proj": ("o",), "fc2": ("down",)}[kind]
    return [sigma(x @ weights[f"A_{n}"].t()) @ weights[f"B_{n}"].t() for n in names]


def local_view(mode, tensor, t, k):
    """The slice of a global input or output tensor that rank k of t holds: boost shards the
    last dimension (hidden, heads, ffn), naive replicates."""
    if mode == "naive" or t == 1:
        return tensor
    return tensor.chunk(t, dim=-1)[k]


def rel_err(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def run_case(kind, mode, act, t, group, k, dtype=torch.float32, wrong_shard=False,
             chunks=1):
    from megatron_boost.measure.collectives import record_collectives

    groups = 4 if kind == "qkv_gqa" else HEADS
    torch.manual_seed(1234)
    layer = build_layer(kind, mode, make_config(t, mode, act, groups, dtype, chunks), group)
    g = torch.Generator().manual_seed(42)
    weights = {n: torch.randn(shape, generator=g) * 0.3
               for n, shape in global_shapes(layer).items()}
    if "layer_norm_weight" in weights:  # a non-trivial γ, so its gradient is tested too
        weights["layer_norm_weight"] = 1.0 + 0.2 * torch.randn(D, generator=g)
    in_size = {"proj": HEADS * HN, "fc2": FFN}.get(kind, D)
    x = torch.randn(S, B, in_size, generator=g)
    x_ref = x.clone().requires_grad_(True)
    ref_w = {n: w.clone().requires_grad_(True) for n, w in weights.items()}
    y_ref = reference(kind, act, ref_w, x_ref)
    grad_out = [torch.randn(y.shape, generator=g) for y in y_ref]
    sum((y * go).sum() for y, go in zip(y_ref, grad_out)).backward()

    if wrong_shard:
        # Negative control: the A factors get the NEXT rank's slice (TP>1) or, at TP=1, their
        # rows reversed, while B stays right. (Swapping A and B shards together would permute
        # the rank-sum consistently and leave the function unchanged.)
        load_global_weights(layer, {n: w.to(dtype) for n, w in weights.items()})
        with torch.no_grad():
            for name, w in weights.items():
                if name.startswith("A_"):
                    wrong = w.chunk(t, dim=axis_of(layer, name))[(k + 1) % t]
                    local(layer, name).copy_(wrong if t > 1 else w.flip(0))
    else:
        load_global_weights(layer, {n: w.to(dtype) for n, w in weights.items()})
    x_loc = local_view(mode, x, t, k).to(dtype).requires_grad_(True)
    with record_collectives(group) as log:
        y, bias = layer(x_loc)
        ys = y if isinstance(y, tuple) else (y,)  # a column group: one output per projection
        g_loc = [local_view(mode, go, t, k).to(dtype) for go in grad_out]
        sum((yp * gp).sum() for yp, gp in zip(ys, g_loc)).backward()
    errs = {"bias_is_none": bias is None, "outputs": len(ys) == len(y_ref),
            "out": max(rel_err(yp, local_view(mode, yr, t, k)) for yp, yr in zip(ys, y_ref)),
            "dx": rel_err(x_loc.grad, local_view(mode, x_ref.grad, t, k))}
    for name in weights:
        errs[f"d{name}"] = rel_err(local(layer, name, grad=True),
                                   shard_of(layer, name, ref_w[name].grad))
    return {"errs": errs, "comm": log.summary()}


def _all_cases(rank, world):
    import torch.distributed as dist

    groups = {}
    for t in TPS:  # every rank creates every group, in the same order
        for start in range(0, world, t):
            grp = dist.new_group(list(range(start, start + t)))
            if start <= rank < start + t:
                groups[t] = (grp, rank - start)
    out = {}
    for t in TPS:
        group, k = groups[t]
        for kind, mode, act in itertools.product(KINDS, MODES, ACTS):
            out[(kind, mode, act, t, "fp32")] = run_case(kind, mode, act, t, group, k)
        for kind, mode in itertools.product(("qkv_gqa", "fc1", "fc2"), MODES):
            out[(kind, mode, "silu", t, "bf16")] = run_case(kind, mode, "silu", t, group, k,
                                                            dtype=torch.bfloat16)
            out[(kind, mode, "silu", t, "wrong")] = run_case(kind, mode, "silu", t, group, k,
                                                             wrong_shard=True)
        for kind in KINDS:  # boost's forward all-reduce pipelined over 3 sequence chunks
            out[(kind, "boost", "silu", t, "chunks")] = run_case(kind, "boost", "silu", t,
                                                                 group, k, chunks=3)
    for t in TPS:  # bf16 with chunks: the fp32 statistic's own all-reduce beside them
        group, k = groups[t]
        out[("fc1", "boost", "silu", t, "bf16-chunks")] = run_case(
            "fc1", "boost", "silu", t, group, k, dtype=torch.bfloat16, chunks=3)
    return out


@pytest.fixture(scope="module")
def results():
    return distributed(_all_cases, 4)


FP32_CASES = list(itertools.product(KINDS, MODES, ACTS, TPS))


@pytest.mark.parametrize("kind,mode,act,tp", FP32_CASES)
def test_layer_matches_reference_fp32(results, kind, mode, act, tp):
    for rank, res in enumerate(results):
        errs = res[(kind, mode, act, tp, "fp32")]["errs"]
        assert errs.pop("bias_is_none") and errs.pop("outputs")
        bad = {n: e for n, e in errs.items() if e > FP32_TOL}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("kind,tp", list(itertools.product(KINDS, TPS)))
def test_pipelined_all_reduce_matches_reference(results, kind, tp):
    """parallel.bottleneck_overlap_chunks: the A GEMM and its all-reduce in three blocks of the
    sequence give the one-block results (fp32 1e-5, bf16 3e-2 as above), with the same bytes
    in three times the forward all-reduces."""
    for rank, res in enumerate(results):
        case = res[(kind, "boost", "silu", tp, "chunks")]
        errs = dict(case["errs"])
        assert errs.pop("bias_is_none") and errs.pop("outputs")
        bad = {n: e for n, e in errs.items() if e > FP32_TOL}
        assert not bad, f"rank {rank}: {bad}"
        one = res[(kind, "boost", "silu", tp, "fp32")]["comm"]["fwd"]
        assert case["comm"]["fwd"]["bytes"] == one["bytes"]
        assert case["comm"]["fwd"]["count"] == 3 * one["count"]
    if kind == "fc1":
        for rank, res in enumerate(results):
            errs = dict(res[("fc1", "boost", "silu", tp, "bf16-chunks")]["errs"])
            assert errs.pop("bias_is_none") and errs.pop("outputs")
            bad = {n: e for n, e in errs.items() if e > BF16_TOL}
            assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("kind,mode,tp", list(itertools.product(("qkv_gqa", "fc1", "fc2"),
                                                                  MODES, TPS)))
def test_layer_matches_reference_bf16(results, kind, mode, tp):
    for rank, res in enumerate(results):
        errs = res[(kind, mode, "silu", tp, "bf16")]["errs"]
        errs.pop("bias_is_none"), errs.pop("outputs")
        bad = {n: e for n, e in errs.items() if e > BF16_TOL}
        assert not bad, f"rank {rank}: {bad}"


@pytest.mark.parametrize("kind,mode,tp", list(itertools.product(("qkv_gqa", "fc1", "fc2"),
                                                                  MODES, TPS)))
def test_negative_control_wrong_shard_is_caught(results, kind, mode, tp):
    worst = max(results[r][(kind, mode, "silu", tp, "wrong")]["errs"]["out"]
                for r in range(4))
    assert worst > 100 * FP32_TOL


def _expected_collectives(kind, mode, groups):
    """docs/design.md §5 table, per layer slot: (fwd widths, bwd widths)."""
    kv = groups * HN
    if mode == "boost":
        r = {"qkv_mha": 3 * R_ATTN, "qkv_gqa": 3 * R_ATTN, "fc1": 2 * R_MLP,
             "proj": R_ATTN, "fc2": R_MLP}[kind]
        norm = 1 if kind.startswith("qkv") or kind == "fc1" else 0
        return [r + norm], [r]
    out = {"qkv_mha": HEADS * HN + 2 * kv, "qkv_gqa": HEADS * HN + 2 * kv, "fc1": 2 * FFN,
           "proj": D, "fc2": D}[kind]
    inp = {"proj": HEADS * HN, "fc2": FFN}.get(kind, D)
    return [out], [inp]


@pytest.mark.parametrize("kind,mode,tp", list(itertools.product(KINDS, MODES, TPS)))
def test_collectives_match_design_table(results, kind, mode, tp):
    groups = 4 if kind == "qkv_gqa" else HEADS
    fwd, bwd = _expected_collectives(kind, mode, groups) if tp > 1 else ([], [])
    for res in results:
        c = res[(kind, mode, "silu", tp, "fp32")]["comm"]
        assert c["fwd"]["widths"] == fwd
        assert c["bwd"]["widths"] == bwd
        # bytes = width · tokens · 4 (fp32)
        assert c["fwd"]["bytes"] == sum(fwd) * S * B * 4
        if mode == "boost":
            # Nothing d- or f-wide crosses the TP group in boost mode.
            assert all(w <= 3 * R_ATTN + 1 for w in c["fwd"]["widths"] + c["bwd"]["widths"])
