"""One shape description (config/shape.py): the bottleneck layers are built from the same
``Projection`` records that ``ModelShape.projections`` gives the formulas (FLOPs, comm widths,
the perf model), so a layer and the arithmetic about it cannot describe different projections."""

from __future__ import annotations

import sys

import pytest

from megatron_boost.config.modes import TPMode
from megatron_boost.config.shape import ModelShape, Projection

SHAPE = ModelShape("t", num_layers=1, hidden=32, ffn=48, heads=4, query_groups=2,
                   attn_rank=8, mlp_rank=12)


def _slot(kind: str):
    """One boost linear slot at TP 1 (no process group needed), built as megatron's layer
    spec builds it: (input_size, output_size)."""
    import torch

    from megatron_boost.config.transformer import BoostTransformerConfig
    from megatron_boost.parallel import layers

    config = BoostTransformerConfig(
        num_layers=1, hidden_size=SHAPE.hidden, num_attention_heads=SHAPE.heads,
        num_query_groups=SHAPE.query_groups, ffn_hidden_size=SHAPE.ffn,
        tp_mode=TPMode.BOOST, attn_rank=SHAPE.attn_rank, mlp_rank=SHAPE.mlp_rank,
        add_bias_linear=False, use_cpu_initialization=True, params_dtype=torch.float32)
    d, f, q, kv = SHAPE.hidden, SHAPE.ffn, SHAPE.q_width, SHAPE.kv_width
    cls, sizes = {"qkv": (layers.BoostLinearQKV, (d, q + 2 * kv)),
                  "proj": (layers.BoostLinearProj, (q, d)),
                  "fc1": (layers.BoostLinearFC1, (d, 2 * f)),
                  "fc2": (layers.BoostLinearFC2, (f, d))}[kind]
    return cls(*sizes, config=config, tp_group=None)


@pytest.mark.parametrize("kind,names", [("qkv", ("q", "k", "v")), ("proj", ("o",)),
                                        ("fc1", ("gate", "up")), ("fc2", ("down",))])
def test_a_layers_projections_are_the_shapes(kind, names):
    expected = {p.name: p for p in SHAPE.projections(TPMode.BOOST)}
    assert list(_slot(kind).projections) == [expected[n] for n in names]


def test_the_shape_description_is_torch_free():
    """The layers import it from below them; the formulas and ``--check`` read it without
    torch or megatron-core."""
    import subprocess

    code = ("import sys, megatron_boost.config.shape; "
            "print(sorted(m for m in ('torch', 'megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip() == "[]"

