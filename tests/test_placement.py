"""The placement table (megatron_boost/config/placement.py) is the one statement of BOOST's
sharding: the layers, the communication formulas, the perf model and the per-rank factor
shapes all read it, so changing one entry changes every one of them."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_boost.analysis.comm import layer_comm_bytes_per_token, tp_comm_widths
from megatron_boost.config.shape import ModelShape
from megatron_boost.config.modes import TPMode
from megatron_boost.config import placement as P
from megatron_boost.perf.model import layer_work

pytestmark = pytest.mark.fast  # the tiers: docs/testing.md

# d, f, ranks and heads all distinct, so each width names its source
SHAPE = ModelShape("t", num_layers=2, hidden=32, ffn=48, heads=4, query_groups=2,
                   attn_rank=8, mlp_rank=12)
TP = 2


def _fc2_layer(**slot_kwargs):
    """A boost fc2 bottleneck at TP 1 (no process group needed to read its sharding)."""
    import torch

    from megatron_boost.config.transformer import BoostTransformerConfig
    from megatron_boost.parallel.layers import BoostLinearFC2

    config = BoostTransformerConfig(
        num_layers=1, hidden_size=SHAPE.hidden, num_attention_heads=SHAPE.heads,
        ffn_hidden_size=SHAPE.ffn, tp_mode=TPMode.BOOST, attn_rank=SHAPE.attn_rank,
        mlp_rank=SHAPE.mlp_rank, add_bias_linear=False, use_cpu_initialization=True,
        params_dtype=torch.float32)
    return BoostLinearFC2(SHAPE.ffn, SHAPE.hidden, config=config, tp_group=None, **slot_kwargs)


def _consumers():
    """What each consumer makes of boost's fc2 (the last group of a layer)."""
    fwd, bwd = tp_comm_widths(SHAPE, TPMode.BOOST)
    work = layer_work(SHAPE, TPMode.BOOST, TP)
    gemm = work.gemms[-2]  # A of fc2 (then B_down)
    shapes = dict(P.local_factor_shapes(TPMode.BOOST, SHAPE.projections(TPMode.BOOST), TP))
    layer = _fc2_layer()
    return {"comm": (fwd[-1], bwd[-1]), "perf_coll": (work.coll_fwd[-1], work.coll_bwd[-1]),
            "perf_gemm": (gemm.N, gemm.K), "local_A": shapes["A_fc2"],
            "layer_axes": (layer.axis_of("A_down"), layer.axis_of("B_down")),
            "layer_norm": hasattr(layer, "layer_norm_weight"), **_sp_consumers()}


def _sp_consumers():
    """What each consumer makes of full rank's fc2 (the last group) with sequence
    parallelism: the formula's widths and forward bytes, and the perf model's last forward
    and backward collectives (kind and width: it prices each by its kind)."""
    fwd, bwd = tp_comm_widths(SHAPE, TPMode.FULL, sequence_parallel=True)
    fwd_bytes, _ = layer_comm_bytes_per_token(SHAPE, TPMode.FULL, sequence_parallel=True)
    work = layer_work(SHAPE, TPMode.FULL, TP, sequence_parallel=True)
    perf = [next(c for c in reversed(work.collectives) if c[0] == way) for way in ("fwd", "bwd")]
    return {"sp_comm": (fwd[-1], bwd[-1], fwd_bytes), "sp_perf_coll": perf}


def test_every_consumer_follows_one_entry(monkeypatch):
    """boost's fc2 as the table states it, then with naive's placement for that one entry
    (A split along the rank, B along it too, the output all-reduced forward and the input
    gradient backward) and a fused norm: each consumer changes with the entry. Likewise full
    rank's fc2 under sequence parallelism (a d-wide reduce-scatter forward, an all-gather
    backward), then with an f-wide all-reduce forward in their place."""
    r, f, d = SHAPE.mlp_rank, SHAPE.ffn, SHAPE.hidden
    assert _consumers() == {"comm": (r, r), "perf_coll": (r, r), "perf_gemm": (r, f / TP),
                            "local_A": (r, f // TP), "layer_axes": (1, 0),
                            "layer_norm": False, "sp_comm": (d, d, 4 * 4 * d),
                            "sp_perf_coll": [("fwd", "reduce_scatter", d),
                                             ("bwd", "all_gather", d)]}
    changed = dataclasses.replace(P.PLACEMENT[(TPMode.NAIVE, P.Group.FC2)], norm=P.Norm.FUSED)
    monkeypatch.setitem(P.PLACEMENT, (TPMode.BOOST, P.Group.FC2), changed)
    full_fc2 = P.PLACEMENT[(TPMode.FULL, P.Group.FC2)]
    monkeypatch.setitem(P.PLACEMENT, (TPMode.FULL, P.Group.FC2), dataclasses.replace(
        full_fc2, sp_fwd=(P.Collective(P.Dim.D_IN, "all_reduce"),)))
    # fwd: output all-reduce d plus the fused statistic's column; bwd: input gradient f.
    # full + SP: fc2's forward is an f-wide all-reduce (fp32 bytes: 3 d-wide ones and it)
    assert _consumers() == {"comm": (d + 1, f), "perf_coll": (d, f),
                            "perf_gemm": (r / TP, f), "local_A": (r // TP, f),
                            "layer_axes": (0, 1), "layer_norm": True,
                            "sp_comm": (f, d, 4 * (3 * d + f)),
                            "sp_perf_coll": [("fwd", "all_reduce", f),
                                             ("bwd", "all_gather", d)]}


def test_table_covers_every_mode_and_group():
    assert set(P.PLACEMENT) == {(m, g) for m in TPMode for g in P.GROUPS}
    for (mode, group), entry in P.PLACEMENT.items():
        assert (entry.b is None) == (mode is TPMode.FULL), (mode, group)
        assert (entry.norm is P.Norm.FUSED) == (mode is TPMode.BOOST and group.is_column)
        # megatron's sequence parallelism is full rank's (config/modes.py refuses it elsewhere)
        assert (entry.sp_fwd is not None) == (entry.sp_bwd is not None) == (mode is TPMode.FULL)


@pytest.mark.parametrize("mode", list(TPMode))
def test_local_factors_hold_a_tp_share_of_the_parameters(mode):
    """Every factor is split in every mode: the local factors hold 1/t of the projections."""
    local = P.local_factor_shapes(mode, SHAPE.projections(mode), TP)
    assert TP * sum(rows * cols for _, (rows, cols) in local) == SHAPE.projection_params(mode)


def test_mode_is_a_tpmode_that_reads_as_its_name():
    """Reports, JSON and dictionaries keyed by the name take a TPMode as they did the str."""
    import json

    assert f"{TPMode.BOOST}" == str(TPMode.BOOST) == "boost"
    assert json.dumps({TPMode.NAIVE: TPMode.FULL}) == '{"naive": "full"}'
    assert {"full": 1}[TPMode.FULL] == 1


def test_a_row_layer_is_its_group_by_type_not_by_its_buffer_name():
    """megatron names the slot's communication buffer; the layer's group, rank and sharding
    do not depend on it (o and down were once told apart by ``tp_comm_buffer_name``)."""
    layer = _fc2_layer(tp_comm_buffer_name="proj")
    assert [(p.name, p.rank) for p in layer.projections] == [("down", SHAPE.mlp_rank)]
    assert layer.group is P.Group.FC2


def test_configs_are_read_by_type_not_by_their_attributes():
    """ModelShape.from_config and the FLOP count's mode tell a RunConfig, a ModelConfig and a
    TransformerConfig apart by type: an object that merely has a config's attributes (a
    ``parallel`` with a mode, a ``model``) is refused, not read."""
    from types import SimpleNamespace

    from megatron_boost.analysis.flops import forward_flops_per_token
    from megatron_boost.config.shape import config_mode
    from megatron_boost.config.run import load_run_config

    cfg = load_run_config("configs/debug.yaml", ["parallel.mode=naive"])
    assert config_mode(cfg) is TPMode.NAIVE and config_mode(cfg.model) is TPMode.BOOST
    assert ModelShape.from_config(cfg) == ModelShape.from_config(cfg.model)
    lookalike = SimpleNamespace(model=cfg.model, parallel=cfg.parallel)
    with pytest.raises(TypeError, match="SimpleNamespace"):
        ModelShape.from_config(lookalike)
    with pytest.raises(TypeError, match="SimpleNamespace"):
        forward_flops_per_token(lookalike)


def test_the_gpu_checks_rank_shapes_follow_the_table(monkeypatch):
    """The GPU check's per-rank layer (analysis/rank_shape.py) shrinks the sizes the table
    splits: boost's fc1 given naive's placement keeps the ffn whole and splits the MLP rank."""
    from megatron_boost.analysis.rank_shape import rank_local_shape

    def sizes():
        local = rank_local_shape(SHAPE, TPMode.BOOST, TP)
        return (local.hidden, local.ffn, local.heads, local.r_attn, local.r_mlp)

    d, f, h = SHAPE.hidden, SHAPE.ffn, SHAPE.heads
    assert sizes() == (d // TP, f // TP, h // TP, SHAPE.attn_rank, SHAPE.mlp_rank)
    monkeypatch.setitem(P.PLACEMENT, (TPMode.BOOST, P.Group.FC1),
                        P.PLACEMENT[(TPMode.NAIVE, P.Group.FC1)])
    assert sizes() == (d // TP, f, h // TP, SHAPE.attn_rank, SHAPE.mlp_rank // TP)
