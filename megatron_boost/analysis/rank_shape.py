"""The shape one tensor-parallel rank computes (docs/design.md §2), and its projection GEMMs.

:func:`rank_local_shape` is the one-process layer whose GEMMs are those of one rank at TP=t;
:func:`rank_layout_problem` says why a layout is one the trainer refuses (the one
TP-divisibility rule, ``config/modes.py`` ``check_tp_split``), so a per-rank shape is only ever
built for a layout the trainer accepts. Used by the GPU check's layer stage (docs/gpu.md).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Set, Tuple

from megatron_boost.config.shape import ModelShape
from megatron_boost.config.modes import check_tp_split
from megatron_boost.config.placement import Dim, Group, placement

__all__ = ["rank_layout_problem", "rank_local_shape", "sharded_sizes", "shape_overrides", "projection_gemms",
           "projection_training_flops"]


def rank_layout_problem(shape: ModelShape, mode: str, tp: int) -> Optional[str]:
    """Why ``mode`` at TP=``tp`` cannot split ``shape`` (the trainer's own rule and message),
    or None when it can."""
    try:
        check_tp_split(mode, tp, hidden_size=shape.hidden, ffn_hidden_size=shape.ffn,
                       num_attention_heads=shape.heads, num_query_groups=shape.g,
                       attn_rank=shape.r_attn, mlp_rank=shape.r_mlp)
    except ValueError as err:
        return str(err)
    return None


def sharded_sizes(mode) -> Set[str]:
    """Which of the layer's sizes a TP rank holds a 1/t share of, read from the placement
    table (``config/placement.py``): a column group's input width is the hidden size, its
    output width the heads (qkv) or the ffn (fc1), its rank the attention or MLP rank; a size is
    sharded when a factor of its group is split along it."""
    sharded = set()
    for group, out_size in ((Group.QKV, "heads"), (Group.FC1, "ffn")):
        entry = placement(mode, group)
        for factor in filter(None, (entry.a, entry.b)):
            if factor.split is None:
                continue
            dim = (factor.rows, factor.cols)[factor.split]
            sharded.add({Dim.D_IN: "hidden", Dim.D_OUT: out_size,
                         Dim.RANK: f"{group.rank_kind}_rank"}[dim])
    return sharded


def rank_local_shape(shape: ModelShape, mode: str, tp: int) -> ModelShape:
    """The one-process layer whose GEMMs are those of one rank at tensor parallelism ``tp``
    (docs/design.md §2), its sharded sizes (:func:`sharded_sizes`: full the heads and ffn;
    naive the bottleneck ranks, attention, the MLP activation and the norms replicated; boost
    the hidden stream, heads and ffn, with the full ranks) divided by ``tp``.
    Raises ValueError (:func:`rank_layout_problem`) for a layout the trainer refuses."""
    problem = rank_layout_problem(shape, mode, tp)
    if problem is not None:
        raise ValueError(problem)
    sharded = sharded_sizes(mode)
    local = dataclasses.replace(shape, head_dim=shape.e)  # e stays e when d or h shrink
    sizes = dict(hidden=shape.hidden, ffn=shape.ffn, heads=shape.heads, query_groups=shape.g,
                 attn_rank=shape.r_attn, mlp_rank=shape.r_mlp)
    if "heads" in sharded:
        sharded.add("query_groups")  # key/value heads split with the query heads
    return dataclasses.replace(local, **{k: v // tp if k in sharded else v
                                         for k, v in sizes.items()})


def shape_overrides(shape: ModelShape) -> List[str]:
    """model.* overrides that build a layer of ``shape``."""
    return [f"model.hidden_size={shape.hidden}", f"model.ffn_hidden_size={shape.ffn}",
            f"model.num_attention_heads={shape.heads}",
            f"model.num_query_groups={shape.g}", f"model.kv_channels={shape.e}",
            f"model.attn_rank={shape.r_attn}", f"model.mlp_rank={shape.r_mlp}"]


def projection_gemms(shape: ModelShape, mode: str) -> List[Tuple[int, int]]:
    """(k, n) of every weight factor of one layer's projections (``ModelShape.projections``):
    a dense W maps k = d_in to n = d_out; a bottleneck is A (d_in -> r) and B (r -> d_out).
    Each runs three GEMMs of 2·tokens·k·n FLOPs in a training step: forward, input gradient,
    weight gradient."""
    factors = []
    for p in shape.projections(mode):
        factors += [(p.d_in, p.d_out)] if p.rank is None else [(p.d_in, p.rank),
                                                              (p.rank, p.d_out)]
    return factors


def projection_training_flops(shape: ModelShape, mode: str, tokens: int) -> float:
    """Training FLOPs of the layer's projections: 3 × forward (Projection.flops_per_token)."""
    return 3.0 * tokens * sum(p.flops_per_token for p in shape.projections(mode))
