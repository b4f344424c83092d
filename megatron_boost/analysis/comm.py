"""Tensor-parallel communication of one decoder layer: the formula (its measurement is
``measure/layer_comm.py``).

:func:`tp_comm_widths` and :func:`layer_comm_formula` give docs/design.md §5's per-layer table,
derived from the one :class:`~megatron_boost.config.shape.ModelShape` for any shape (GQA,
kv_channels, separate attention / MLP ranks). MHA reduces to full 2d / 2d, naive 5d + 2f /
3d + f, boost 7r + 2 / 7r (BOOST, arXiv 2512.12131). Plain Python: the perf model and its CLI
import it without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from megatron_boost.config.modes import TPMode
from megatron_boost.config.placement import (GROUPS, Norm, collective_widths,
                                               layer_collectives, placement)
from megatron_boost.config.shape import MODES, ModelShape, check_mode


__all__ = ["MODES", "CROSS_ENTROPY_FP32_VALUES", "tp_collectives", "tp_comm_widths",
           "fp32_statistic_columns",
           "layer_comm_formula", "layer_comm_bytes_per_token", "embedding_collectives",
           "head_collectives", "StepCommShape",
           "step_comm_bytes"]

_ELEMENT_BYTES = {"fp32": 4, "bf16": 2}
#: megatron's vocab-parallel cross entropy all-reduces three fp32 values per token forward (the
#: maximum logit, the target logit and the sum of exponentials), whatever the activation dtype.
CROSS_ENTROPY_FP32_VALUES = 3


def tp_collectives(shape: ModelShape, mode: str, dtype: str = "fp32",
                   sequence_parallel: bool = False) -> List[Tuple[str, str, int]]:
    """(direction, kind, elements per token) of one layer's TP collectives, forward then
    backward, as the placement table states them
    (:func:`megatron_boost.config.placement.layer_collectives`; widths:
    :func:`tp_comm_widths`)."""
    mode = check_mode(mode)
    return layer_collectives(mode, shape.projections(mode), products_fp32=dtype == "fp32",
                             sequence_parallel=sequence_parallel)


def tp_comm_widths(shape: ModelShape, mode: str, dtype: str = "fp32",
                   sequence_parallel: bool = False) -> Tuple[List[int], List[int]]:
    """(forward, backward) widths, elements per token, of one layer's TP collectives, in issue
    order (docs/design.md §5), read from the placement table
    (:func:`megatron_boost.config.placement.collective_widths`):

    * full: row-parallel proj and fc2 all-reduce their d-wide outputs forward; column-parallel
      qkv and fc1 all-reduce their d-wide input gradients backward. With megatron's sequence
      parallelism (the table's sequence-parallel variant of full mode) each all-reduce becomes
      a reduce-scatter plus an all-gather, each handed the whole d-wide activation (the same
      bytes on the wire: a ring all-reduce is the two): forward, the all-gather of the
      sequence shards before qkv and fc1 and the reduce-scatter of proj's and fc2's outputs;
      backward, their conjugates and qkv's and fc1's re-gather of their input for the weight
      gradient.
    * naive: each chunk all-reduces its output forward (qkv: h·e + 2·g·e, o: d, gate+up: 2f,
      down: d) and its input gradient backward (qkv: d, o: h·e, fc1: d, fc2: f).
    * boost: one all-reduce of the group's bottleneck forward (qkv: 3r_a + 1 with the fused
      online-RMSNorm sum of squares, docs/design.md §3; o: r_a, gate+up: 2r_m + 1, down: r_m)
      and of its gradient backward (the same without the +1). With bf16 activations the
      fp32 sum of squares is all-reduced on its own (one fp32 value per token), started
      before the A GEMM, so qkv and gate+up issue two forward all-reduces each: 1 then 3r_a,
      1 then 2r_m.
    """
    mode = check_mode(mode)
    return collective_widths(mode, shape.projections(mode), products_fp32=dtype == "fp32",
                             sequence_parallel=sequence_parallel)


def fp32_statistic_columns(mode: str, dtype: str) -> int:
    """Forward all-reduces per layer that carry online-RMSNorm's statistic as fp32 on their own
    (one value per token): boost's two fused norms when the activations are not fp32
    (docs/design.md §3); otherwise the statistic rides in the products' all-reduce."""
    if dtype == "fp32":
        return 0
    return sum(placement(mode, group).norm is Norm.FUSED for group in GROUPS)


def _formula_text(shape: ModelShape, mode: TPMode) -> Tuple[str, str]:
    """The symbolic (forward, backward) formula: the MHA shorthand where it applies."""
    if mode is TPMode.FULL:
        return "2d", "2d"
    if mode is TPMode.NAIVE:
        mha = shape.g == shape.heads and shape.q_width == shape.hidden
        return ("5d + 2f", "3d + f") if mha else ("(h+2g)e + 2d + 2f", "2d + he + f")
    if shape.r_attn == shape.r_mlp:
        return "7r + 2", "7r"
    return "4r_a + 3r_m + 2", "4r_a + 3r_m"


def layer_comm_formula(cfg: Any, mode: str, dtype: str = "fp32") -> Dict[str, Any]:
    """Per-decoder-layer TP collectives, elements per token, of a config (or ModelShape) in
    activation ``dtype``: fwd/bwd widths (:func:`tp_comm_widths`), their sums and counts, the
    forward one-column fp32 collectives (:func:`fp32_statistic_columns`) and the symbolic
    formula."""
    shape = cfg if isinstance(cfg, ModelShape) else ModelShape.from_config(cfg)
    mode = check_mode(mode)
    if mode is TPMode.BOOST and (shape.attn_rank is None or shape.mlp_rank is None):
        raise ValueError("boost mode needs attn_rank and mlp_rank")
    fwd, bwd = tp_comm_widths(shape, mode, dtype)
    text = _formula_text(shape, mode)
    return {"fwd_elems_per_token": sum(fwd), "bwd_elems_per_token": sum(bwd),
            "fwd_count": len(fwd), "bwd_count": len(bwd),
            "fwd_widths": fwd, "bwd_widths": bwd,
            "fwd_fp32_columns": fp32_statistic_columns(mode, dtype),
            "fwd_formula": text[0], "bwd_formula": text[1]}


def layer_comm_bytes_per_token(shape: ModelShape, mode: str, dtype: str = "fp32",
                               sequence_parallel: bool = False) -> Tuple[int, int]:
    """(forward, backward) bytes per token one decoder layer hands to TP collectives: the
    widths of :func:`tp_comm_widths` in the activation dtype, except online-RMSNorm's statistic
    columns, which are fp32 whatever the activation dtype (docs/design.md §3)."""
    fwd, bwd = tp_comm_widths(shape, mode, dtype, sequence_parallel)
    esize = _ELEMENT_BYTES[dtype]
    fp32_columns = fp32_statistic_columns(mode, dtype)
    return sum(fwd) * esize + fp32_columns * (4 - esize), sum(bwd) * esize


def embedding_collectives(shape: ModelShape, mode: str,
                          sequence_parallel: bool = False) -> List[Tuple[str, str, int]]:
    """(direction, kind, elements per token) of the embedding's TP collectives, once per
    micro-batch on the first stage (docs/design.md §2, §5). full and naive: megatron's
    vocab-parallel embedding all-reduces its d-wide output forward, tied or not (the output
    layer reading the same table adds nothing on the input side); with sequence parallelism
    (full) that all-reduce is a reduce-scatter to the sequence shards, all-gathered backward.
    boost: the untied table is sharded along d and needs none; the tied one (vocab-parallel,
    megatron's) reduce-scatters the d-wide partial rows forward and all-gathers their gradient
    backward, each recorded at its full width d
    (:func:`~megatron_boost.measure.collectives.record_collectives`)."""
    d = shape.hidden
    if check_mode(mode) is not TPMode.BOOST:
        if sequence_parallel:
            return [("fwd", "reduce_scatter", d), ("bwd", "all_gather", d)]
        return [("fwd", "all_reduce", d)]
    if shape.tied_embeddings:
        return [("fwd", "reduce_scatter", d), ("bwd", "all_gather", d)]
    return []


def head_collectives(shape: ModelShape, mode: str,
                     sequence_parallel: bool = False) -> List[Tuple[str, str, int]]:
    """(direction, kind, elements per token) of the head's d-wide TP collectives, once per
    micro-batch on the last stage (docs/design.md §5): boost all-gathers the hidden shards
    before the final norm (its backward is a split, no collective); megatron's output layer
    all-reduces its d-wide input gradient backward in every mode. With sequence parallelism
    (full) the output layer all-gathers its sequence-sharded input forward, and backward
    reduce-scatters the input gradient and re-gathers the input for its weight gradient. The
    vocab-parallel cross entropy's fp32 values come on top (:data:`CROSS_ENTROPY_FP32_VALUES`)."""
    d = shape.hidden
    if sequence_parallel:
        return [("fwd", "all_gather", d), ("bwd", "reduce_scatter", d), ("bwd", "all_gather", d)]
    gather = [("fwd", "all_gather", d)] if check_mode(mode) is TPMode.BOOST else []
    return gather + [("bwd", "all_reduce", d)]


def _bytes_per_token(collectives: List[Tuple[str, str, int]], esize: int) -> Dict[str, int]:
    """{'fwd', 'bwd'}: bytes per token of (direction, kind, width) collectives."""
    out = {"fwd": 0, "bwd": 0}
    for direction, _kind, width in collectives:
        out[direction] += width * esize
    return out


@dataclass(frozen=True)
class StepCommShape:
    """What one rank runs in a training step, as far as its TP collectives go."""

    tp: int
    """Tensor-parallel size (1: no TP collective at all)."""
    tokens_per_microbatch: int
    """micro_batch_size · seq_length."""
    num_microbatches: int
    """Micro-batches per step on this rank."""
    local_layers: int
    """Decoder layers of this rank's model chunks (all virtual stages)."""
    has_embedding: bool
    """This rank runs the embedding (first pipeline stage)."""
    has_head: bool
    """This rank runs the final norm, the output layer and the loss (last pipeline stage)."""
    full_recompute: bool = False
    """megatron's full activation recompute re-runs each layer's forward, collectives
    included, during the backward (low-rank recompute replays them, docs/design.md §7)."""
    sequence_parallel: bool = False
    """Full mode with megatron's sequence parallelism (:func:`tp_comm_widths`)."""


def step_comm_bytes(shape: ModelShape, mode: str, dtype: str,
                    step: StepCommShape) -> Dict[str, int]:
    """{'fwd', 'bwd'}: bytes this rank hands to TP collectives in one training step, from the
    formula (docs/design.md §5), what :func:`record_collectives` measures around the step.

    Per micro-batch and token: the decoder layers (:func:`layer_comm_bytes_per_token`); the
    embedding's (:func:`embedding_collectives`: full and naive all-reduce d forward, tied boost
    reduce-scatters d forward and all-gathers d backward); at the head
    (:func:`head_collectives`), boost's forward all-gather of the d-wide hidden stream, the
    output layer's backward all-reduce of its d-wide input gradient (every mode) and the fp32
    values of the vocab-parallel cross entropy. With sequence parallelism (full) the
    embedding's all-reduce is a reduce-scatter (all-gather backward) and the head all-gathers
    its d-wide input forward and re-gathers it backward for the output layer's weight
    gradient; once per step, the norms' weight gradients (partial sums over the sequence
    shards) are all-reduced over the TP group, fp32 (megatron's ``finalize_model_grads``;
    gradients are reduced in fp32). Megatron's embedding-group all-reduce of a tied table's
    gradient (pp > 1) runs between the first and last stage, not over TP, and is not counted
    here."""
    if step.tp == 1:
        return {"fwd": 0, "bwd": 0}
    mode = check_mode(mode)
    esize, d = _ELEMENT_BYTES[dtype], shape.hidden
    sp = step.sequence_parallel and mode is TPMode.FULL
    layer_fwd, layer_bwd = layer_comm_bytes_per_token(shape, mode, dtype, sp)
    fwd = step.local_layers * layer_fwd
    bwd = step.local_layers * (layer_bwd + (layer_fwd if step.full_recompute else 0))
    if step.has_embedding:
        emb = _bytes_per_token(embedding_collectives(shape, mode, sp), esize)
        fwd, bwd = fwd + emb["fwd"], bwd + emb["bwd"]
    if step.has_head:
        head = _bytes_per_token(head_collectives(shape, mode, sp), esize)
        fwd += head["fwd"] + CROSS_ENTROPY_FP32_VALUES * 4
        bwd += head["bwd"]
    tokens = step.tokens_per_microbatch * step.num_microbatches
    norms = 2 * step.local_layers + int(step.has_head)  # each layer's two, the final one
    return {"fwd": fwd * tokens, "bwd": bwd * tokens + (norms * d * 4 if sp else 0)}


#: The BOOST authors' per-layer forward TP communication of LLaMA-7B (d 4096, f 11008, r 1024,
