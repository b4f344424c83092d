"""The per-layer op ledger (megatron_boost/measure/ledger.py, docs/design.md §17).

Checked: its GEMM FLOPs and collective bytes against the shapes and the placement table (the
ledger measures, the table states: they must agree); the classes and stand-ins of the CUDA op
graph; that the boost layer at the BOOST paper's 7B TP 4 per-rank shapes keeps this round's
targets; and, as negative controls, that a concatenation put back into the boost layer and an
fp32 copy of the bottleneck kept for backward each show up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_boost.analysis.comm import tp_comm_widths
from megatron_boost.measure.ledger import LedgerSpec, layer_ledger, ledger_in_process
from megatron_boost.config.layout import Layout
from megatron_boost.config.shape import ModelShape
from megatron_boost.config.placement import local_factor_shapes

pytestmark = [pytest.mark.fast, pytest.mark.compat]  # the tiers: docs/testing.md

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# d, f, heads and ranks distinct, so a width names its source; GQA
SMALL = ModelShape("small", num_layers=2, hidden=64, ffn=96, heads=4, query_groups=2,
                   vocab=256, seq_length=32, attn_rank=16, mlp_rank=24)
PAPER_7B = ModelShape("paper-7b", num_layers=32, hidden=4096, ffn=11008, heads=32,
                      vocab=32000, seq_length=4096, attn_rank=1024, mlp_rank=1024,
                      tied_embeddings=True)


def _measured(spec):
    """A fresh measurement (not the process's cache: a test may change the code under it)."""
    from megatron_boost.runtime.cpu_mode import cpu_mode_left_as_found, use_cpu

    with cpu_mode_left_as_found():
        use_cpu(force=True)
        return ledger_in_process(spec)


@pytest.mark.parametrize("mode", ["full", "naive", "boost"])
def test_gemm_flops_and_collective_bytes_are_the_tables(mode):
    """Forward GEMM FLOPs are 2·T·Σ N·K over the placement table's local factors, backward
    twice that; the collectives carry the design table's widths × tokens × 2 bytes (bf16; the
    fused norm's statistic: 4), forward and backward."""
    t, b = 2, 2
    spec = LedgerSpec(shape=SMALL, layout=Layout(mode=mode, tp=t), micro_batch=b, seq_length=32)
    ledger = layer_ledger(spec)
    tokens = b * 32
    factors = local_factor_shapes(mode, SMALL.projections(mode), t)
    flops = 2.0 * tokens * sum(rows * cols for _, (rows, cols) in factors)
    assert ledger.gemm_flops("fwd") == flops
    assert ledger.gemm_flops("bwd") == 2 * flops
    fwd, bwd = tp_comm_widths(SMALL, mode, dtype="bf16")
    size = {1: 4}  # the statistic's fp32 value per token
    for phase, widths in (("fwd", fwd), ("bwd", bwd)):
        measured = sorted(c.bytes for c in ledger.collectives if c.phase == phase)
        assert measured == sorted(tokens * w * size.get(w, 2) for w in widths), phase


def test_the_cuda_op_graph_counts_fused_kernels_once():
    """Full rank: its norms, RoPE and SwiGLU are one kernel each way (the stand-ins for TE's
    and megatron's fused kernels), the CPU's eager kernels counted apart; boost: its own
    regions likewise, and its backward all-reduces are asynchronous and overlapped by GEMMs."""
    full = layer_ledger(LedgerSpec(shape=SMALL, layout=Layout(mode="full", tp=2), seq_length=32))
    names = [k.name for k in full.select(kind="fused")]
    for name in ("rms_norm", "rms_norm_backward", "rope", "rope_backward", "swiglu",
                 "swiglu_backward"):
        assert name in names, names
    assert full.count(kind="attention") == 2  # one kernel forward, one backward
    assert full.eager_count() > full.count()
    boost = layer_ledger(LedgerSpec(shape=SMALL, layout=Layout(mode="boost", tp=2), seq_length=32))
    regions = {k.name for k in boost.select(kind="fused")}
    assert {"sum_of_squares", "scale_and_activate", "scale_and_activate_backward",
            "_gated", "_gated_backward"} <= regions, regions
    backward = [c for c in boost.collectives if c.phase == "bwd"]
    assert backward and all(c.async_op and not c.exposed for c in backward)


def test_boost_at_the_paper_7b_shapes_keeps_this_rounds_targets():
    """One boost layer of the paper's 7B at TP 4 (d/t 1024, r 1024, f/t 2752, B·S 16384, bf16):
    no layout copy outside the attention core and RoPE, no fp32 [s, b, w > 1] kept for
    backward, at most 3.0 GB of element-wise and copy traffic (besides flash attention's dQ
    accumulator passes and the gradients' accumulation into main_grad, wherever it runs),
    1.0 GiB of saved activations, and 75 kernels forward and backward WITH the gradients'
    accumulation: the factors accumulate in their weight-gradient GEMMs (parallel/wgrad.py),
    so DDP's hook adds only the two norm weights, and the fused norm's γ-scaled A factors add
    in place (two kernels); before that 72 + 10 DDP adds = 82. Attention backward counts as
    flash attention launches it (three kernels; measure/kernel_models.py); 76 before the
    residual's gradient was added in the A sides' dgrad GEMMs (parallel/residual.py: 74 for a
    layer inside the decoder, the ledger's). Before the lean
    round: 12 copies, 0.31 GiB of fp32 products kept, 11.7 GB, 1.46 GiB, 130 kernels:
    docs/results/layer-ops-paper-7b-before.json."""
    ledger = layer_ledger(LedgerSpec(shape=PAPER_7B, layout=Layout(mode="boost", tp=4),
                                     micro_batch=4, seq_length=4096))
    assert ledger.layout_copies() == []
    assert ledger.saved_fp32_wide == []
    # the flash backward's dQ accumulator passes (counted since the stand-in launches them)
    # are the attention kernel's, not the layer's glue this target was set for
    flash = sum(k.bytes for k in ledger.kernels if k.name in (
        "attention_backward_preprocess", "attention_backward_convert_dq"))
    accumulation = sum(k.bytes for k in ledger.grad_accumulation())
    assert ledger.traffic() - flash - accumulation <= 3.0e9
    assert ledger.saved_bytes <= 2 ** 30
    assert len(ledger.ddp_accumulation()) == 2  # the norm weights only
    assert ledger.count() <= 75


def test_a_concatenation_put_back_is_a_copy(monkeypatch):
    """Negative control: the B side's input gradient assembled by concatenating the
    projections' products (as the layers did before, a one-tensor concatenation for proj and
    fc2 included) shows as layout copies, one per group."""
    import torch

    from megatron_boost.parallel import bottleneck

    def concatenated(grads, b, rows, ranks, like):
        dz = torch.cat([g @ w for g, w in zip(grads, b.split(list(rows)))], dim=-1)
        return dz.view(*like.shape[:-1], sum(ranks))

    spec = LedgerSpec(shape=SMALL, layout=Layout(mode="boost", tp=2), seq_length=32)
    assert _measured(spec).layout_copies() == []
    monkeypatch.setattr(bottleneck, "_up_project_dgrad", concatenated)
    copies = _measured(spec).layout_copies()
    assert [k.name for k in copies] == ["aten.cat.default"] * 4  # fc2, fc1, proj, qkv


def test_an_fp32_bottleneck_kept_for_backward_is_listed(monkeypatch):
    """Negative control: the scale and σ composed by autograd in fp32 (as the layers did
    before) keep an fp32 [s, b, Σr] for backward, which the ledger lists (qkv's 3·r_attn and
    fc1's 2·r_mlp); the fused regions keep none."""
    from megatron_boost.parallel import bottleneck, layers, online_rmsnorm

    def autograd_up(products, sumsq, b, geometry, link=None, residual=None):
        activation = geometry.activation
        z = activation.act(products)
        if sumsq is not None:
            inv = online_rmsnorm.inverse_rms(sumsq, activation.hidden_size, activation.eps)
            z = activation.act((products.float() * inv).to(products.dtype))
        ys = bottleneck.split_project(z, b.split(list(geometry.rows)), geometry.ranks)
        return ys if residual is None else [ys[0] + residual]  # the block's output

    spec = LedgerSpec(shape=SMALL, layout=Layout(mode="boost", tp=2), seq_length=32)
    assert _measured(spec).saved_fp32_wide == []
    monkeypatch.setattr(layers, "up_project", autograd_up)
    ledger = _measured(spec)
    assert sorted(s["shape"][-1] for s in ledger.saved_fp32_wide) == [2 * 24, 3 * 16]


def test_the_tool_prints_and_writes_each_layer(tmp_path):
    out = tmp_path / "ledger.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "layer_ops.py"), "--config",
         "configs/debug.yaml", "--tp", "2", "--modes", "full,full+sp,naive,boost",
         "--json", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    tables = proc.stdout.split("\n\n")
    rows = [line for line in tables[0].splitlines() if line.startswith("| ")]
    labels = ["| full", "| full+sp", "| naive", "| boost"]
    assert [r.split(" | ")[0] for r in rows[1:]] == labels
    timed = [line for line in tables[1].splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in timed[1:]] == labels  # the time table, h100-sxm
    assert "(h100-sxm)" in timed[0]
    data = json.loads(out.read_text())
    assert [d["spec"]["mode"] for d in data] == ["full", "full", "naive", "boost"]
    assert all(d["summary"]["total"]["kernels"] == len(d["kernels"]) for d in data)


def test_the_tool_refuses_a_layout_in_one_line():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "layer_ops.py"), "--config",
         "configs/debug.yaml", "--tp", "3"], capture_output=True, text=True, timeout=300,
        cwd=ROOT)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: full at TP=3: "), proc.stderr


def test_models_of_one_layer_shape_share_a_measurement(monkeypatch):
    """A ledger is one layer's: two models that differ only in name, depth and tying are
    measured once (the performance model sizes many), each ledger keeps its caller's spec,
    and another layer shape is measured anew."""
    import dataclasses

    from megatron_boost.measure import ledger as ledger_module

    measured = []

    def measured_once(spec):
        measured.append(spec)
        return ledger_module.LayerLedger(spec=spec, kernels=[], collectives=[], saved_bytes=0,
                                         saved_by_scope={}, saved_fp32_wide=[])

    monkeypatch.setattr(ledger_module, "_CACHE", {})
    monkeypatch.setattr(ledger_module, "_measured_here", measured_once)
    deeper = dataclasses.replace(SMALL, name="deeper", num_layers=8, tied_embeddings=True)
    wider = dataclasses.replace(SMALL, ffn=128)
    specs = [LedgerSpec(shape, layout=Layout(mode="boost", tp=2), seq_length=32, dtype="fp32")
             for shape in (SMALL, deeper, wider)]
    ledgers = ledger_module.measure_ledgers(specs)
    assert len(measured) == 2
    assert [ledger.spec for ledger in ledgers] == specs
