"""The bottleneck layers build what the placement table (config/placement.py) states: the
factors' local shapes from their PLACEMENT entry, the fused norm's γ from the NORM_WEIGHT entry
and whether the norm gathers its statistic from the STREAM entry. Changing one entry changes
what the layer builds. The layers are built in-process as rank 0 of a TP group of two (the
group's size and rank patched: building a layer issues no collective)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_boost.config import placement as P
from megatron_boost.config.modes import TPMode

pytestmark = pytest.mark.fast  # the tiers: docs/testing.md

# d, f and the ranks distinct, so each width names its source
D, FFN, HEADS, R_ATTN, R_MLP, TP = 32, 48, 4, 8, 12, 2


@pytest.fixture
def two_ranks(monkeypatch):
    """Rank 0 of a TP group of two, as the layers see it."""
    from megatron_boost.parallel import layers

    monkeypatch.setattr(layers, "get_pg_size", lambda group: TP)
    monkeypatch.setattr(layers, "get_pg_rank", lambda group: 0)


def _layer(cls_name: str):
    from megatron_boost.config.transformer import BoostTransformerConfig
    from megatron_boost.parallel import layers

    config = BoostTransformerConfig(
        num_layers=1, hidden_size=D, num_attention_heads=HEADS, ffn_hidden_size=FFN,
        tp_mode=TPMode.BOOST, attn_rank=R_ATTN, mlp_rank=R_MLP, add_bias_linear=False,
        use_cpu_initialization=True, params_dtype=torch.float32,
        tensor_model_parallel_size=TP)
    out = 2 * FFN if cls_name.endswith("FC1") else D
    in_size = FFN if cls_name.endswith("FC2") else D
    return getattr(layers, cls_name)(in_size, out, config=config, tp_group=None)


def _gamma(layer) -> tuple:
    """γ's local width, whether it is TP-sharded and along which axis."""
    gamma = layer.layer_norm_weight
    sharded = getattr(gamma, "tensor_model_parallel", False)
    return tuple(gamma.shape), sharded, gamma.partition_dim if sharded else None


def test_gamma_follows_the_norm_weight_entry(two_ranks, monkeypatch):
    """boost's γ is split along its one axis as the table states ([d/t], TP attribute on axis
    0); with the entry replicated the layer builds the whole [d], with no TP attribute."""
    assert _gamma(_layer("BoostLinearFC1")) == ((D // TP,), True, 0)
    monkeypatch.setitem(P.TENSORS, (TPMode.BOOST, P.Tensor.NORM_WEIGHT), P.TensorPlacement(None))
    assert _gamma(_layer("BoostLinearFC1")) == ((D,), False, None)


def test_the_statistic_follows_the_stream_entry(two_ranks, monkeypatch):
    """A hidden-sharded stream (the table's boost entry) makes the fused norm gather its
    statistic with the products; a replicated stream leaves a plain norm before the GEMM."""
    x = torch.randn(4, 2, D // TP)
    assert _layer("BoostLinearFC1")._a_side(x)[2] is True
    monkeypatch.setitem(P.TENSORS, (TPMode.BOOST, P.Tensor.STREAM), P.TensorPlacement(None))
    assert _layer("BoostLinearFC1")._a_side(x)[2] is False


def _factor_shapes(layer) -> dict:
    return {which: [tuple(f.shape) for f in layer.factors(which)] for which in ("A", "B")}


def test_factor_shapes_follow_the_factor_entry(two_ranks, monkeypatch):
    """boost's fc2 splits A along d_in and B along d_out; given naive's entry (both split
    along the rank) the same class builds naive's shards."""
    assert _factor_shapes(_layer("BoostLinearFC2")) == {"A": [(R_MLP, FFN // TP)],
                                                        "B": [(D // TP, R_MLP)]}
    naive = P.PLACEMENT[(TPMode.NAIVE, P.Group.FC2)]
    monkeypatch.setitem(P.PLACEMENT, (TPMode.BOOST, P.Group.FC2),
                        dataclasses.replace(naive, norm=P.Norm.NONE))
    layer = _layer("BoostLinearFC2")
    assert _factor_shapes(layer) == {"A": [(R_MLP // TP, FFN)], "B": [(D, R_MLP // TP)]}
    assert (layer.A.partition_dim, layer.B.partition_dim) == (0, 1)
