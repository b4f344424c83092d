"""The tensor-parallel modes and the size rules of each: the mode names (one enum), the default
bottleneck rank and TP divisibility, written once for config validation, the layers' config
(``megatron_boost/config/transformer.py``) and the perf model.

Plain Python on purpose: loading and checking a configuration (``pretrain_lowrank.py --check``
on a login node, ``scripts/slurm/submit.sh``, the perf model's refusal of a layout) imports
neither torch nor megatron-core, which take seconds to import.
"""

from __future__ import annotations

import enum
from typing import Iterable, List, Optional, Tuple

__all__ = ["TPMode", "default_rank", "tp_sharded_sizes", "check_divisible_by_tp",
           "check_tp_split", "check_pipeline_seq_length", "resolve_sequence_parallel"]


class TPMode(str, enum.Enum):
    """How a decoder is tensor-parallelised (docs/design.md §2)."""

    FULL = "full"
    """Full-rank model, megatron-core's own column/row-parallel TP (baseline 1)."""
    NAIVE = "naive"
    """Bottleneck model, each (A, B) pair parallelised like a Megatron MLP: A column-parallel,
    B row-parallel + all-reduce of the output; replicated residual stream (baseline 2)."""
    BOOST = "boost"
    """Bottleneck model with BOOST's bottleneck-aware TP: hidden-sharded residual stream, one
    all-reduce of the r-wide bottleneck per projection group (the product)."""

    # A mode reads, prints and hashes as its name (as enum.StrEnum, Python 3.11+), so reports,
    # JSON and dictionaries keyed by the name take either.
    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, value) -> "TPMode":
        if isinstance(value, cls):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            raise ValueError(
                f"tp_mode ({value!r}) must be one of {[m.value for m in cls]}") from None

    @property
    def is_lowrank(self) -> bool:
        return self is not TPMode.FULL


def default_rank(hidden_size: int, rank_ratio: float = 0.25) -> int:
    """The bottleneck rank when none is given: round(rank_ratio · d), at least 1 (CoLA uses
    about d/4)."""
    return max(1, int(round(rank_ratio * hidden_size)))


def check_bottleneck_ranks(mode, hidden_size: int, **ranks: Optional[int]) -> None:
    """The rule of a bottleneck model's ranks (``attn_rank=.., mlp_rank=..``), checked by the
    run validation and by BoostTransformerConfig: each a positive integer no wider than the
    layer it factorises."""
    mode = TPMode.parse(mode)
    for name, value in ranks.items():
        if value is None or int(value) <= 0:
            raise ValueError(
                f"{name} ({value}) must be a positive integer in {mode.value} mode; set "
                f"model.{name} (CoLA uses about hidden_size/4)")
        if value > hidden_size:
            raise ValueError(
                f"{name} ({value}) must not exceed hidden_size ({hidden_size}): a bottleneck "
                f"wider than the layer it factorises saves nothing; lower model.{name} or "
                f"model.rank_ratio")


def check_lowrank_recompute(mode, lowrank_recompute: bool) -> None:
    """Low-rank activation checkpointing exists only for the bottleneck modes."""
    if lowrank_recompute and not TPMode.parse(mode).is_lowrank:
        raise ValueError(
            "recompute 'lowrank' (low-rank activation checkpointing) applies to the naive "
            "and boost modes; for the full-rank model use recompute 'selective' or 'full'")


# Why a size is split, by the size the table's split axes fall on (config/placement.py).
_WHY_SPLIT = {
    "hidden_size": "the residual stream is sharded along the hidden dimension",
    "attn_rank": "A is split along the rank",
    "mlp_rank": "A is split along the rank",
    "ffn_hidden_size": "the MLP is sharded along the ffn dimension",
}


def _table_split_sizes(mode) -> set:
    """The names of the model sizes the placement table splits in ``mode``: a factor's split
    axis falls on a group's d_in, d_out or rank (qkv/fc1 read d; proj/fc2 write d; fc1 writes
    and fc2 reads the ffn; qkv writes and proj reads the heads), the residual stream's on d
    when it is split along its last axis [s, b, d]."""
    # placement.py imports TPMode from here: imported late, both modules stay plain Python.
    from megatron_boost.config.placement import (GROUPS, Dim, Group, Tensor, split_dims,
                                                 tensor_split)

    ffn_or_heads = {Group.QKV: "num_attention_heads", Group.PROJ: "num_attention_heads",
                    Group.FC1: "ffn_hidden_size", Group.FC2: "ffn_hidden_size"}
    names = set()
    for group in GROUPS:
        stream_side = Dim.D_IN if group.is_column else Dim.D_OUT
        for dim in split_dims(mode, group):
            names.add(f"{group.rank_kind}_rank" if dim is Dim.RANK
                      else "hidden_size" if dim is stream_side else ffn_or_heads[group])
    if tensor_split(mode, Tensor.STREAM) == 2:  # [s, b, d]: split along d
        names.add("hidden_size")
    return names


def tp_sharded_sizes(mode, *, hidden_size: int, ffn_hidden_size: Optional[int],
                     num_attention_heads: int, num_query_groups: Optional[int],
                     attn_rank: Optional[int], mlp_rank: Optional[int]
                     ) -> List[Tuple[str, int, str]]:
    """(name, size, why) of every size that ``mode`` splits over the TP ranks, derived from
    the placement table (``config/placement.py``, docs/design.md §2). boost never shards the
    rank (the bottleneck is replicated after its all-reduce)."""
    split = _table_split_sizes(mode)  # the heads are listed below in every mode
    values = {"hidden_size": hidden_size, "attn_rank": attn_rank, "mlp_rank": mlp_rank,
              "ffn_hidden_size": ffn_hidden_size}
    sizes = [(name, values[name], why) for name, why in _WHY_SPLIT.items()
             if name in split and not (name == "ffn_hidden_size" and ffn_hidden_size is None)]
    groups = num_query_groups if num_query_groups is not None else num_attention_heads
    # megatron's TransformerConfig requires heads and groups to divide in every mode (full
    # and boost shard attention by heads, each rank holding whole key/value groups).
    sizes += [("num_attention_heads", num_attention_heads, "attention is split by heads"),
              ("num_query_groups", groups, "each rank holds whole key/value groups")]
    return sizes


def check_divisible_by_tp(tp: int, sizes: Iterable[Tuple[str, int, str]], mode) -> None:
    """Raise ValueError naming the first (name, size, why) not divisible by ``tp``."""
    for name, size, why in sizes:
        if size is not None and size % tp:
            raise ValueError(
                f"{name} ({size}) must be divisible by tensor_model_parallel_size ({tp}) in "
                f"{TPMode.parse(mode).value} mode ({why}); choose a multiple of {tp}")


def check_tp_split(mode, tp: int, **sizes) -> None:
    """The one TP-divisibility rule (config validation, the layers' model, the perf model):
    every size :func:`tp_sharded_sizes` lists divides by ``tp``, and heads by query groups."""
    check_divisible_by_tp(tp, tp_sharded_sizes(mode, **sizes), mode)
    heads = sizes["num_attention_heads"]
    groups = sizes.get("num_query_groups") or heads
    if heads % groups:
        raise ValueError(
            f"num_attention_heads ({heads}) must be divisible by num_query_groups ({groups})")


def check_pipeline_seq_length(mode, tp: int, pp: int, seq_length: int) -> None:
    """A mode whose stream the placement table splits between stages (boost: the hidden
    shard [s, b, d/t]) with pipeline parallelism: stages exchange it as an [s/t, b, d] p2p
    buffer (megatron's schedules size it from seq_length), so s must divide by t. Checked by
    the run validation and when the model is driven (``model/gpt.py``)."""
    from megatron_boost.config.placement import Tensor, is_split  # see _table_split_sizes

    mode = TPMode.parse(mode)
    if is_split(mode, Tensor.STREAM) and pp > 1 and seq_length % tp:
        raise ValueError(
            f"seq_length ({seq_length}) must be divisible by tensor_model_parallel_size ({tp}) "
            f"for {mode.value} with pipeline parallelism (pipeline size {pp}): stages exchange "
            f"the [s, b, d/t] shard as an [s/t, b, d] buffer; choose a multiple of {tp} or "
            f"another layout")


# Why each low-rank mode refuses megatron's sequence parallelism (docs/design.md §2).
_NO_SEQUENCE_PARALLEL = {
    TPMode.NAIVE: (
        "naive parallelises each bottleneck on its own (A column-, B row-parallel) around "
        "attention, the activation and the norms on the replicated stream; megatron's sequence "
        "parallelism needs the stream between a block's TP linears to be TP-sharded (heads, "
        "ffn), so here every bottleneck would need its own all-gather and reduce-scatter"),
    TPMode.BOOST: (
        "boost's residual stream is already sharded along the hidden dimension, norms "
        "included; there is no replicated region left to shard along the sequence"),
}


def resolve_sequence_parallel(mode, tp: int, requested: Optional[bool]) -> Tuple[bool, str]:
    """(on, why) for ``parallel.sequence_parallel`` (null: on for full at tp > 1, as megatron
    users run full-rank TP). Raises ValueError for ``true`` in naive or boost mode."""
    mode = TPMode.parse(mode)
    if mode is not TPMode.FULL:
        if requested:
            raise ValueError(
                f"parallel.sequence_parallel (true) does not apply to {mode.value} mode: "
                f"{_NO_SEQUENCE_PARALLEL[mode]}; set it to null or false")
        return False, f"{mode.value} mode"
    if tp == 1:
        return False, "tp=1: nothing to shard"
    if requested is False:
        return False, "parallel.sequence_parallel=false (the BOOST paper's full-rank baseline)"
    return True, ("parallel.sequence_parallel=true" if requested
                  else "full mode at tp > 1 (megatron's default practice)")
