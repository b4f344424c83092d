"""The op ledger's stand-ins for CUDA kernels the CPU cannot run
(megatron_boost/measure/kernel_models.py, docs/design.md §17): what each launches and keeps is
the CUDA library's. Negative controls: the RoPE stand-in keeping a tensor of the rotated
tensor's shape, and the attention backward counted as one kernel, each fail a test here."""

from __future__ import annotations

import pytest

from megatron_boost.measure.ledger import LedgerSpec, layer_ledger
from megatron_boost.config.layout import Layout
from megatron_boost.config.shape import ModelShape

pytestmark = pytest.mark.fast

SMALL = ModelShape("small", num_layers=2, hidden=64, ffn=96, heads=4, query_groups=2,
                   vocab=256, seq_length=32, attn_rank=16, mlp_rank=24)
SEQ, BATCH, TP = 32, 2, 2


def _full():
    return layer_ledger(LedgerSpec(shape=SMALL, layout=Layout(mode="full", tp=TP),
                                   micro_batch=BATCH, seq_length=SEQ))


def test_rope_keeps_only_its_frequencies():
    """Transformer Engine's fused RoPE saves its frequencies ([s, 1, 1, e] fp32) and nothing
    of q or k: the attention module's own saved bytes are the frequencies alone."""
    frequencies = SEQ * SMALL.e * 4
    assert _full().saved_by_scope["self_attention"] == frequencies


def test_attention_backward_is_three_kernels_with_an_fp32_dq_accumulator():
    """Backward: rowsum(dO * O) with the fp32 dQ accumulator zeroed, the main kernel (the
    core's FLOPs, 2.5x the forward's) reading and writing that accumulator, dQ's conversion."""
    ledger = _full()
    core = [k for k in ledger.select("bwd") if k.scope == "self_attention.core_attention"]
    assert [k.name for k in core] == ["attention_backward_preprocess", "attention_backward",
                                      "attention_backward_convert_dq"]
    heads = SMALL.heads // TP
    q_fp32 = BATCH * heads * SEQ * SMALL.e * 4
    pre, main, convert = core
    assert pre.write == q_fp32 + BATCH * heads * SEQ * 4  # the accumulator and D
    assert convert.read == q_fp32 and convert.write == q_fp32 // 2
    forward = ledger.select("fwd", "attention")[0]
    assert main.flops == 2.5 * forward.flops > 0


def test_te_rmsnorm_backward_is_two_kernels():
    """TE's RMSNorm backward: dx with fp32 partial sums of dgamma, then their reduction."""
    from megatron_boost.measure.kernel_models import NORM_DGAMMA_PARTS

    for scope in ("input_layernorm", "pre_mlp_layernorm"):
        kernels = [k for k in _full().select("bwd")
                   if k.scope == scope and k.name.startswith("rms_norm")]
        assert [k.name for k in kernels] == ["rms_norm_backward", "rms_norm_backward_finalize"]
        assert kernels[1].read == NORM_DGAMMA_PARTS * SMALL.hidden * 4
