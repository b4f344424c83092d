"""BOOST's sharding, declared once: the placement table (docs/design.md §2, §5).

For every TP mode and every projection group of a decoder layer (qkv, proj, fc1, fc2) the
table :data:`PLACEMENT` states

* the global shapes of the factors, A: [r, d_in] and B: [d_out, r] (full rank: one dense
  W: [d_out, d_in] in the place of A, and no B),
* the axis of each factor split over the TP ranks (None: replicated),
* the forward and backward collectives of the group with their widths (elements per token),
  and, for full rank, those megatron's sequence parallelism issues in their place,
* where the input norm and its statistic live (:class:`Norm`).

and for every tensor outside the projection factors (the residual stream between the groups,
the fused norm's γ, the final norm's γ, the embedding table, the output layer and the
bottleneck latent) :data:`TENSORS` states the axis split over the TP ranks, with megatron's
sequence parallelism and with tied embeddings where those change it.

Everything else reads it: the layers (``parallel/layers.py``) take their split axes from it, the
communication formulas (``analysis/comm.py``), the perf model's GEMM shapes and parameters
(``perf/model.py``) and the per-rank factor shapes (:func:`local_factor_shapes`) their sizes;
the TP-divisibility rule (``config/modes.py``), the model's embedding and pipeline views
(``model/gpt.py``), Muon (``train/muon.py``), the op ledger and the FLOP count read it too.

Plain Python on purpose, like ``config/modes.py``: ``--check`` and the perf model's layout
checks import it without torch.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from megatron_boost.config.modes import TPMode

__all__ = ["Group", "Dim", "Norm", "Factor", "Collective", "GroupPlacement", "PLACEMENT",
           "GROUPS", "GROUP_PROJECTIONS", "placement", "group_of_projection", "widths",
           "layer_collectives", "collective_widths", "local_factor_shapes",
           "placement_markdown", "Tensor", "TensorPlacement", "TENSORS", "tensor_split",
           "split_shape", "is_split", "local_numel", "tensor_local_shape", "split_dims", "tensors_markdown"]


class Group(str, enum.Enum):
    """A projection group: the projections that read one input (BOOST's "linear layer
    grouping"), named after megatron's linear slot."""

    QKV = "qkv"
    PROJ = "proj"
    FC1 = "fc1"
    FC2 = "fc2"

    @property
    def is_column(self) -> bool:
        """A group reading the residual stream (its norm in front of it)."""
        return self in (Group.QKV, Group.FC1)

    @property
    def writes_residual(self) -> bool:
        """A group whose output is added to the residual stream (megatron's scaled
        output-layer init applies to it)."""
        return not self.is_column

    @property
    def rank_kind(self) -> str:
        """Which configured rank its bottlenecks use: "attn" or "mlp"."""
        return "attn" if self in (Group.QKV, Group.PROJ) else "mlp"


#: The groups in the order a layer issues them, and their projections in output order.
GROUPS = (Group.QKV, Group.PROJ, Group.FC1, Group.FC2)
GROUP_PROJECTIONS: Dict[Group, Tuple[str, ...]] = {
    Group.QKV: ("q", "k", "v"), Group.PROJ: ("o",), Group.FC1: ("gate", "up"),
    Group.FC2: ("down",)}


class Dim(str, enum.Enum):
    """A size of a group: its input width, its summed output width, its summed rank."""

    D_IN = "d_in"
    D_OUT = "d_out"
    RANK = "r"


class Norm(str, enum.Enum):
    """Where the norm in front of a group runs, and where its statistic rides."""

    NONE = "none"
    """No norm in front of the group (proj, fc2)."""
    REPLICATED = "replicated"
    """megatron's RMSNorm on the replicated stream before the group; no collective."""
    FUSED = "fused"
    """online-RMSNorm fused into the group (docs/design.md §3): the fp32 sum of squares rides
    as one extra column of the group's forward all-reduce when the products are fp32, and has
    its own fp32 all-reduce of width 1, issued first, otherwise."""


@dataclass(frozen=True)
class Factor:
    """One weight factor: global shape (rows, cols) in group sizes, and its split axis."""

    rows: Dim
    cols: Dim
    split: Optional[int]
    """The axis sharded over the TP ranks; None: replicated."""


@dataclass(frozen=True)
class Collective:
    """One collective of the group, ``width`` elements per token handed to it (an all-gather
    and a reduce-scatter are recorded at their full width, as ``measure/collectives.py``
    records them)."""

    width: Dim
    kind: str = "all_reduce"
    """"all_reduce", "all_gather" or "reduce_scatter"."""


@dataclass(frozen=True)
class GroupPlacement:
    """The sharding of one group in one mode."""

    a: Factor
    """A: [r, d_in] (full rank: the dense W: [d_out, d_in])."""
    b: Optional[Factor]
    """B: [d_out, r]; None for a dense projection."""
    fwd: Tuple[Collective, ...]
    bwd: Tuple[Collective, ...]
    norm: Norm
    sp_fwd: Optional[Tuple[Collective, ...]] = None
    """With megatron's sequence parallelism: the forward collectives in place of ``fwd``;
    None: the mode has no sequence-parallel variant (config/modes.py refuses it there)."""
    sp_bwd: Optional[Tuple[Collective, ...]] = None
    """With sequence parallelism: the backward collectives in place of ``bwd``."""


_A, _B, _W = (Dim.RANK, Dim.D_IN), (Dim.D_OUT, Dim.RANK), (Dim.D_OUT, Dim.D_IN)


_AG, _RS = "all_gather", "reduce_scatter"


def _column_full() -> GroupPlacement:
    """megatron's ColumnParallelLinear: its input gradient all-reduced backward. With sequence
    parallelism it all-gathers the [s/t, b, d] input forward; backward it re-gathers the input
    for the weight gradient, then reduce-scatters the input gradient (megatron's
    ``LinearWithGradAccumulationAndAsyncCommunication``, in that order)."""
    return GroupPlacement(Factor(*_W, 0), None, (), (Collective(Dim.D_IN),), Norm.REPLICATED,
                          sp_fwd=(Collective(Dim.D_IN, _AG),),
                          sp_bwd=(Collective(Dim.D_IN, _AG), Collective(Dim.D_IN, _RS)))


def _row_full() -> GroupPlacement:
    """megatron's RowParallelLinear: its output all-reduced forward. With sequence parallelism
    it reduce-scatters the output to the sequence shards forward and all-gathers the gradient
    backward (the same bytes on the wire: a ring all-reduce is the two)."""
    return GroupPlacement(Factor(*_W, 1), None, (Collective(Dim.D_OUT),), (), Norm.NONE,
                          sp_fwd=(Collective(Dim.D_OUT, _RS),),
                          sp_bwd=(Collective(Dim.D_OUT, _AG),))


def _naive(norm: Norm) -> GroupPlacement:  # one megatron "MLP" per group
    return GroupPlacement(Factor(*_A, 0), Factor(*_B, 1), (Collective(Dim.D_OUT),),
                          (Collective(Dim.D_IN),), norm)


def _boost(norm: Norm) -> GroupPlacement:  # BOOST: only the r-wide bottleneck crosses ranks
    return GroupPlacement(Factor(*_A, 1), Factor(*_B, 0), (Collective(Dim.RANK),),
                          (Collective(Dim.RANK),), norm)


#: THE table: (mode, group) -> placement.
PLACEMENT: Dict[Tuple[TPMode, Group], GroupPlacement] = {
    (TPMode.FULL, Group.QKV): _column_full(),
    (TPMode.FULL, Group.PROJ): _row_full(),
    (TPMode.FULL, Group.FC1): _column_full(),
    (TPMode.FULL, Group.FC2): _row_full(),
    (TPMode.NAIVE, Group.QKV): _naive(Norm.REPLICATED),
    (TPMode.NAIVE, Group.PROJ): _naive(Norm.NONE),
    (TPMode.NAIVE, Group.FC1): _naive(Norm.REPLICATED),
    (TPMode.NAIVE, Group.FC2): _naive(Norm.NONE),
    (TPMode.BOOST, Group.QKV): _boost(Norm.FUSED),
    (TPMode.BOOST, Group.PROJ): _boost(Norm.NONE),
    (TPMode.BOOST, Group.FC1): _boost(Norm.FUSED),
    (TPMode.BOOST, Group.FC2): _boost(Norm.NONE),
}


class Tensor(str, enum.Enum):
    """A tensor of the model outside the projection factors, by its global shape."""

    STREAM = "stream"
    """The residual stream between the groups and between layers, [s, b, d]."""
    NORM_WEIGHT = "norm_weight"
    """γ of the norm in front of qkv and fc1, [d]."""
    FINAL_NORM_WEIGHT = "final_norm_weight"
    """γ of the final norm, [d]."""
    EMBEDDING = "embedding"
    """The word embedding table, [V, d]."""
    HEAD = "head"
    """The output layer's weight, [V, d] (the embedding table when tied)."""
    LATENT = "latent"
    """A bottleneck's latent between its A and B factors (products P and z = σ(P)),
    [s, b, r]; only the low-rank modes have one."""


@dataclass(frozen=True)
class TensorPlacement:
    """The sharding of one tensor in one mode."""

    split: Optional[int]
    """The axis of the global shape split over the TP ranks; None: replicated."""
    sp_split: Optional[int] = None
    """With megatron's sequence parallelism (full rank only): the split axis in its place."""
    tied_split: Optional[int] = None
    """With tied embeddings: the split axis in its place (boost's table is then megatron's
    vocab-parallel one, the tensor the output layer reads)."""


_VOCAB, _REPLICATED = TensorPlacement(0), TensorPlacement(None)

#: The other half of THE table: (mode, tensor) -> placement. Full rank and naive keep
#: megatron's replicated stream and norms and its vocab-parallel ends; naive's latent is split
#: along the rank (A column-parallel). boost shards the stream, its γ and the untied embedding
#: along the hidden dimension, and replicates the latent after its all-reduce and the final
#: norm's γ (the final norm runs on the gathered stream: ``GatheredRMSNorm``, model/gpt.py).
TENSORS: Dict[Tuple[TPMode, Tensor], TensorPlacement] = {
    (TPMode.FULL, Tensor.STREAM): TensorPlacement(None, sp_split=0),
    (TPMode.FULL, Tensor.NORM_WEIGHT): _REPLICATED,
    (TPMode.FULL, Tensor.FINAL_NORM_WEIGHT): _REPLICATED,
    (TPMode.FULL, Tensor.EMBEDDING): _VOCAB,
    (TPMode.FULL, Tensor.HEAD): _VOCAB,
    (TPMode.NAIVE, Tensor.STREAM): _REPLICATED,
    (TPMode.NAIVE, Tensor.NORM_WEIGHT): _REPLICATED,
    (TPMode.NAIVE, Tensor.FINAL_NORM_WEIGHT): _REPLICATED,
    (TPMode.NAIVE, Tensor.EMBEDDING): _VOCAB,
    (TPMode.NAIVE, Tensor.HEAD): _VOCAB,
    (TPMode.NAIVE, Tensor.LATENT): TensorPlacement(2),
    (TPMode.BOOST, Tensor.STREAM): TensorPlacement(2),
    (TPMode.BOOST, Tensor.NORM_WEIGHT): TensorPlacement(0),
    (TPMode.BOOST, Tensor.FINAL_NORM_WEIGHT): _REPLICATED,
    (TPMode.BOOST, Tensor.EMBEDDING): TensorPlacement(1, tied_split=0),
    (TPMode.BOOST, Tensor.HEAD): _VOCAB,
    (TPMode.BOOST, Tensor.LATENT): _REPLICATED,
}


def tensor_split(mode, tensor: Tensor, *, sequence_parallel: bool = False,
                 tied: bool = False) -> Optional[int]:
    """The axis of ``tensor`` split over the TP ranks in ``mode`` (None: replicated), from
    :data:`TENSORS`; ``sequence_parallel`` / ``tied`` select the entry's variant where it
    declares one."""
    entry = TENSORS[(TPMode.parse(mode), Tensor(tensor))]
    if sequence_parallel and entry.sp_split is not None:
        return entry.sp_split
    if tied and entry.tied_split is not None:
        return entry.tied_split
    return entry.split


def is_split(mode, tensor: Tensor, **variant: bool) -> bool:
    """Whether ``tensor`` is split over the TP ranks in ``mode`` (``variant``: the keywords of
    :func:`tensor_split`)."""
    return tensor_split(mode, tensor, **variant) is not None


def local_numel(mode, tensor: Tensor, numel, tp: int, **variant: bool):
    """``numel`` elements of ``tensor`` (or a size proportional to them) as one of ``tp`` ranks
    holds them in ``mode``: ``numel / tp`` where the table splits the tensor, else ``numel``
    (``variant``: the keywords of :func:`tensor_split`)."""
    return numel / tp if is_split(mode, tensor, **variant) else numel


def tensor_local_shape(mode, tensor: Tensor, shape: Sequence[int], tp: int, *,
                       divide: Callable = operator.floordiv, **variant: bool) -> tuple:
    """``shape``, the global shape of ``tensor``, as one of ``tp`` ranks holds it in ``mode``:
    the table's split axis divided by ``divide`` (``variant``: the keywords of
    :func:`tensor_split`)."""
    return split_shape(shape, tensor_split(mode, tensor, **variant), tp, divide)


def split_shape(shape: Sequence[int], split: Optional[int], tp: int,
                divide: Callable = operator.floordiv) -> tuple:
    """``shape`` on one of ``tp`` ranks: axis ``split`` (a table entry's; None: replicated)
    divided by ``divide``."""
    local = list(shape)
    if split is not None:
        local[split] = divide(local[split], tp)
    return tuple(local)


def split_dims(mode, group: Group) -> List[Dim]:
    """The sizes of ``group`` (d_in, d_out, r) along which a factor of it is split in
    ``mode``, in factor order (A then B), each once."""
    entry = placement(mode, group)
    dims: List[Dim] = []
    for factor in filter(None, (entry.a, entry.b)):
        if factor.split is not None:
            dim = (factor.rows, factor.cols)[factor.split]
            dims += [dim] if dim not in dims else []
    return dims


def placement(mode, group: Group) -> GroupPlacement:
    """The table's entry of ``mode`` (a TPMode or its name) and ``group``."""
    return PLACEMENT[(TPMode.parse(mode), Group(group))]


def group_of_projection(name: str) -> Group:
    """The group a projection (q, k, v, o, gate, up, down) belongs to."""
    for group, names in GROUP_PROJECTIONS.items():
        if name in names:
            return group
    raise ValueError(f"projection '{name}' is in no group; one of "
                     f"{[n for names in GROUP_PROJECTIONS.values() for n in names]}")


def _group_members(projections: Sequence, group: Group) -> list:
    """The members of ``group`` among ``projections`` (objects with name, d_in, d_out, rank:
    ``config.shape.Projection``), in output order."""
    by_name = {p.name: p for p in projections}
    return [by_name[n] for n in GROUP_PROJECTIONS[group]]


def widths(projections: Sequence, group: Group) -> Dict[Dim, int]:
    """The group's sizes: d_in, Σ d_out and Σ r (0 for dense projections)."""
    members = _group_members(projections, group)
    return {Dim.D_IN: members[0].d_in, Dim.D_OUT: sum(p.d_out for p in members),
            Dim.RANK: sum(p.rank or 0 for p in members)}


def _entry_collectives(entry: GroupPlacement, sequence_parallel: bool
                       ) -> Tuple[Tuple[Collective, ...], Tuple[Collective, ...]]:
    """The entry's (forward, backward) collectives; its sequence-parallel variant where asked
    and declared (a mode without one ignores the flag, as megatron's SP is full rank's)."""
    if sequence_parallel and entry.sp_fwd is not None:
        return entry.sp_fwd, entry.sp_bwd
    return entry.fwd, entry.bwd


def layer_collectives(mode, projections: Sequence, products_fp32: bool = True,
                      sequence_parallel: bool = False) -> List[Tuple[str, str, int]]:
    """(direction, kind, elements per token) of one layer's TP collectives, the forward ones
    then the backward ones, each in layer order (docs/design.md §5), from the table. A fused
    norm's statistic adds one column to its group's first forward all-reduce when
    ``products_fp32``, else is an all-reduce of width 1 of its own issued before it.
    ``sequence_parallel``: the table's sequence-parallel variant of the mode's collectives."""
    fwd: List[Tuple[str, str, int]] = []
    bwd: List[Tuple[str, str, int]] = []
    for group in GROUPS:
        entry, sizes = placement(mode, group), widths(projections, group)
        group_fwd, group_bwd = _entry_collectives(entry, sequence_parallel)
        forward = [("fwd", c.kind, sizes[c.width]) for c in group_fwd]
        if entry.norm is Norm.FUSED:
            if products_fp32:
                forward[0] = ("fwd", forward[0][1], forward[0][2] + 1)
            else:
                forward.insert(0, ("fwd", "all_reduce", 1))
        fwd += forward
        bwd += [("bwd", c.kind, sizes[c.width]) for c in group_bwd]
    return fwd + bwd


def collective_widths(mode, projections: Sequence, products_fp32: bool = True,
                      sequence_parallel: bool = False) -> Tuple[List[int], List[int]]:
    """(forward, backward) widths of :func:`layer_collectives`, elements per token."""
    collectives = layer_collectives(mode, projections, products_fp32, sequence_parallel)
    return ([w for direction, _, w in collectives if direction == "fwd"],
            [w for direction, _, w in collectives if direction == "bwd"])


def _local(factor: Factor, sizes: Dict[Dim, int], tp: int, divide: Callable) -> tuple:
    return split_shape((sizes[factor.rows], sizes[factor.cols]), factor.split, tp, divide)


def local_factor_shapes(mode, projections: Sequence, tp: int,
                        divide: Callable = operator.floordiv) -> List[Tuple[str, tuple]]:
    """(name, local [rows, cols]) of every weight factor of one layer on one of ``tp`` ranks:
    per group the grouped A ``A_<group>`` ([Σ r_p, d_in] split as the table says) and each
    projection's B ``B_<p>``; full rank: the group's dense W ``W_<group>``. ``projections``
    are ``config.shape.ModelShape.projections(mode)``; ``divide`` splits a sharded size."""
    out = []
    for group in GROUPS:
        entry = placement(mode, group)
        sizes = widths(projections, group)
        if entry.b is None:
            out.append((f"W_{group.value}", _local(entry.a, sizes, tp, divide)))
            continue
        out.append((f"A_{group.value}", _local(entry.a, sizes, tp, divide)))
        for p in _group_members(projections, group):
            own = {Dim.D_IN: p.d_in, Dim.D_OUT: p.d_out, Dim.RANK: p.rank}
            out.append((f"B_{p.name}", _local(entry.b, own, tp, divide)))
    return out


def _split_text(factor: Optional[Factor]) -> str:
    if factor is None:
        return "—"
    dims = [factor.rows.value, factor.cols.value]
    if factor.split is not None:
        dims[factor.split] += "/t"
    return f"[{', '.join(dims)}]"


def _collectives_text(collectives: Tuple[Collective, ...], norm: Norm) -> str:
    texts = [c.width.value for c in collectives]
    if norm is Norm.FUSED:
        texts[0] += " + 1"
    return ", ".join(f"AR({t})" for t in texts) or "—"


def placement_markdown() -> str:
    """Both tables as docs/design.md §2 shows them (tests/test_design_doc.py checks it)."""
    lines = ["| mode | group | A (W) local | B local | forward | backward | norm |",
             "|---|---|---|---|---|---|---|"]
    for (mode, group), e in PLACEMENT.items():
        lines.append(f"| {mode.value} | {group.value} | {_split_text(e.a)} | "
                     f"{_split_text(e.b)} | {_collectives_text(e.fwd, e.norm)} | "
                     f"{_collectives_text(e.bwd, Norm.NONE)} | {e.norm.value} |")
    return "\n".join(lines) + "\n\n" + tensors_markdown()



def tensors_markdown() -> str:
    """:data:`TENSORS` as docs/design.md §2 shows it."""
    def axis(split: Optional[int]) -> str:
        return "replicated" if split is None else f"axis {split}"

    lines = ["| mode | tensor | split | with SP | tied |", "|---|---|---|---|---|"]
    for (mode, tensor), e in TENSORS.items():
        lines.append(f"| {mode.value} | {tensor.value} | {axis(e.split)} | "
                     f"{axis(e.sp_split) if e.sp_split is not None else '—'} | "
                     f"{axis(e.tied_split) if e.tied_split is not None else '—'} |")
    return "\n".join(lines)
