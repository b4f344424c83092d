"""Bottleneck linear layers y = B·σ(A·x) for the naive and boost tensor-parallel modes.

Every dense projection of the decoder (q, k, v, o, gate, up, down) is a bottleneck
(CoLA, arXiv 2502.10940). Projections that read the same input form one *group* (q, k, v; gate,
up) whose A factors run as one GEMM and one collective (BOOST, arXiv 2512.12131, "linear layer
grouping"). Global parameter shapes, identical in every mode and at every TP size:

    A_<p>: [r_p, d_in]      B_<p>: [d_out_p, r_p]

boost (BOOST's bottleneck-aware TP, docs/design.md §2):
    A_<p>: [r_p, d_in/t]  sharded along d_in (dim 1; the input is hidden/head/ffn-sharded)
    B_<p>: [d_out_p/t, r_p] sharded along d_out (dim 0; the output is head/ffn/hidden-sharded)
    layer_norm_weight: [d_in/t] (fused online-RMSNorm, column layers only)
    One all-reduce of width Σr (+1 with the norm in fp32) forward, one of width Σr backward;
    with bf16 products the norm's fp32 statistic has an all-reduce of its own, started before
    the A GEMM. The norm's arithmetic and σ run as fused regions (``parallel/online_rmsnorm.py``),
    the GEMMs and collectives in the autograd Functions of ``parallel/bottleneck.py``.

naive ("vanilla TP", Megatron's MLP pattern applied to each (A, B) pair):
    A_<p>: [r_p/t, d_in]  sharded along r (dim 0; column-parallel, replicated input)
    B_<p>: [d_out_p, r_p/t] sharded along r (dim 1; row-parallel, all-reduce of the output)
    Forward: all-reduce of the group's output (width Σ d_out); backward: all-reduce of the
    input gradient (width d_in).

The eight classes at the bottom (one per mode and slot, made by one factory, :func:`_slot`) obey
megatron-core's constructor contract for the linear slots of a layer spec (``linear_qkv``,
``linear_proj``, ``linear_fc1``, ``linear_fc2``) and return ``(output, None)``: these layers
have no bias. A column slot's output is the tuple of its
projections' outputs ((q, k, v); (gate, up)), which ``BottleneckSelfAttention`` and
``BottleneckMLP`` (``model/blocks.py``) take in place of megatron's fused layouts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import get_pg_rank, get_pg_size, make_tp_sharded_tensor_for_checkpoint

from megatron_boost.compat import linear_with_dgrad_allreduce
from megatron_boost.config.modes import TPMode, check_divisible_by_tp
from megatron_boost.config.placement import (GROUP_PROJECTIONS, Dim, Group, Norm, Tensor,
                                             placement, tensor_split)
from megatron_boost.config.shape import Projection
from megatron_boost.config.transformer import (BoostTransformerConfig, get_bottleneck_activation,
                                               get_bottleneck_activation_grad, is_identity)
from megatron_boost.parallel.bottleneck import (BottleneckActivation, BottleneckGeometry,
                                                GradientLink, down_project, split_project,
                                                up_project)
from megatron_boost.parallel.interleave import in_half
from megatron_boost.parallel.mappings import copy_to_tensor_model_parallel_region, reduce_forward
from megatron_boost.parallel.online_rmsnorm import autograd_activation_grad, fold_norm_weight
from megatron_boost.parallel.pipeline import PipelinePlan, pipelined_bottleneck
from megatron_boost.parallel.residual import take_offered_residual
from megatron_boost.parallel.wgrad import accumulation_target, column_parallel_a, row_parallel_b

__all__ = [
    "cola_std",
    "cola_init_",
    "WeightFactor",
    "BottleneckGroup",
    "BoostBottleneckGroup",
    "NaiveBottleneckGroup",
    "BoostLinearQKV",
    "BoostLinearFC1",
    "BoostLinearProj",
    "BoostLinearFC2",
    "NaiveLinearQKV",
    "NaiveLinearFC1",
    "NaiveLinearProj",
    "NaiveLinearFC2",
]


def cola_std(rank: int, d_in: int, d_out: int) -> float:
    """CoLA's init std of both factors of a bottleneck d_in -> r -> d_out
    (CoLA, arXiv 2502.10940): r^(-1/4) · (d_in + d_out)^(-1/4)."""
    return rank ** -0.25 * (d_in + d_out) ** -0.25


def cola_init_(master: torch.Tensor, rank: int, d_in: int, d_out: int) -> torch.Tensor:
    """CoLA initialisation of a global factor in place: normal(0, cola_std)."""
    with torch.no_grad():
        master.normal_(0.0, cola_std(rank, d_in, d_out))
    return master




class WeightFactor(str, enum.Enum):
    """A factor of the bottleneck y = B·σ(A·x). Its global shape and split axis are the
    placement table's (``config/placement.py``); its parameter is the attribute of its name."""

    A = "A"
    B = "B"

    def placed(self, mode: TPMode, group: Group):
        """The table's ``Factor`` entry (global dims and split axis) of this factor."""
        entry = placement(mode, group)
        return entry.a if self is WeightFactor.A else entry.b

    def init_method(self, config: BoostTransformerConfig):
        """megatron's init of this factor's master: A reads the layer input, B writes the
        output (the scaled output-layer init where megatron applies it)."""
        return config.init_method if self is WeightFactor.A else config.output_layer_init_method


#: The hidden axis of the residual stream [s, b, d]: a stream split along it reaches a column
#: group as hidden shards, so its fused norm gathers the statistic over the ranks.
_HIDDEN_AXIS = 2


class BottleneckGroup(MegatronModule):
    """A group of bottleneck projections y_p = B_p·σ(A_p·x) sharing one input.

    Subclasses fix the mode and the group, and write the forward; every split (the factors'
    :meth:`split_axis` and shapes, γ's width and axis, whether the stream arrives as hidden
    shards) and whether the input norm is fused come from the placement table
    (``config/placement.py``). With megatron's ``perform_initialization`` the global weights
    are drawn on the CPU, one master tensor per factor in a fixed order (A_p then B_p for each
    projection), and sliced: the same seed gives the same global weights in every mode and at
    every TP size; without it they are left empty for the layout-independent init
    (``model/init.py``).

    Args:
        config: the model config (ranks, activation, init, dtype).
        input_size: global d_in.
        projections: the projections of the group, in output order.
        tp_group: the tensor-parallel group the factors are sharded over.
    """

    mode: TPMode
    group: Group

    def __init__(self, config: BoostTransformerConfig, input_size: int,
                 projections: Sequence[Projection], tp_group):
        super().__init__(config=config)
        self.input_size = input_size
        self.projections = list(projections)
        self.tp_group = tp_group
        self.tp_size = get_pg_size(tp_group)
        self.tp_rank = get_pg_rank(tp_group)
        self.activation = get_bottleneck_activation(config.bottleneck_activation)
        self.fuse_norm = placement(self.mode, self.group).norm is Norm.FUSED
        self.eps = config.layernorm_epsilon
        self._check_divisible()
        device = (torch.device("cpu") if config.use_cpu_initialization
                  or not torch.cuda.is_available() else torch.cuda.current_device())
        shards: Dict[WeightFactor, List[torch.Tensor]] = {f: [] for f in WeightFactor}
        for p in self.projections:  # drawn in the order A_p, B_p (same seed, same weights)
            for factor in WeightFactor:
                shards[factor].append(self._initial_shard(factor, p, device))
        # Each factor of the group stored as ONE parameter, the projections' factors stacked by
        # rows: A [Σ local r, local d_in], B [Σ local d_out, local r] (a group shares one
        # rank). The A GEMM reads A as it is; the B GEMMs read row views of B, one batched
        # GEMM when the projections have equal shapes (docs/design.md §4). Checkpoints still
        # hold A_<p>, B_<p> (sharded_state_dict); factors(A), factors(B) are the row views.
        for factor in WeightFactor:
            setattr(self, factor.value, self._grouped_parameter(shards[factor],
                                                                self.split_axis(factor)))
        if self.fuse_norm:
            self.layer_norm_weight = self._norm_weight(device)

    # -- shapes, from the placement table ---------------------------------------------------

    def split_axis(self, factor: WeightFactor) -> Optional[int]:
        """The axis of ``factor`` sharded over the TP group (the table's entry)."""
        return factor.placed(self.mode, self.group).split

    def _global_shape(self, factor: WeightFactor, p: Projection) -> Tuple[int, int]:
        """[rows, cols] of projection ``p``'s factor, in the table's dims (A: [r, d_in],
        B: [d_out, r])."""
        placed = factor.placed(self.mode, self.group)
        sizes = {Dim.D_IN: self.input_size, Dim.D_OUT: p.d_out, Dim.RANK: p.rank}
        return sizes[placed.rows], sizes[placed.cols]

    def _local_shape(self, factor: WeightFactor, p: Projection) -> Tuple[int, int]:
        """This rank's [rows, cols] of projection ``p``'s factor: its split axis divided."""
        shape = list(self._global_shape(factor, p))
        axis = self.split_axis(factor)
        if axis is not None:
            shape[axis] //= self.tp_size
        return shape[0], shape[1]

    def _local_rows(self, factor: WeightFactor) -> List[int]:
        """Each projection's rows of the grouped factor (boost: A's whole r, B's d_out/t;
        naive: A's r/t, B's whole d_out)."""
        return [self._local_shape(factor, p)[0] for p in self.projections]

    def _latent_widths(self) -> List[int]:
        """Each projection's local columns of the latent z (B's local columns: boost's whole
        r, naive's r/t)."""
        return [self._local_shape(WeightFactor.B, p)[1] for p in self.projections]

    def _stream_is_sharded(self) -> bool:
        """The residual stream reaches this group as hidden shards over more than one rank
        (the table's STREAM entry): the fused norm's statistic must be gathered."""
        return tensor_split(self.mode, Tensor.STREAM) == _HIDDEN_AXIS and self.tp_size > 1

    # -- parameters -------------------------------------------------------------------------

    @staticmethod
    def _grouped_parameter(shards: List[torch.Tensor], axis: int) -> torch.nn.Parameter:
        param = torch.nn.Parameter(torch.cat(shards, dim=0) if len(shards) > 1 else shards[0])
        set_tensor_model_parallel_attributes(param, is_parallel=True, dim=axis, stride=1)
        return param

    def _initial_shard(self, factor: WeightFactor, p: Projection, device) -> torch.Tensor:
        """This rank's shard of projection ``p``'s factor: drawn as the global master and
        sliced, or left uninitialised without megatron's ``perform_initialization`` (the
        layout-independent init then writes it, docs/design.md §8)."""
        dtype = self.config.params_dtype
        if not self.config.perform_initialization:
            return torch.empty(self._local_shape(factor, p), device=device, dtype=dtype)
        master = torch.empty(*self._global_shape(factor, p), dtype=torch.float32)
        if self.config.cola_init:
            cola_init_(master, p.rank, self.input_size, p.d_out)
        else:
            factor.init_method(self.config)(master)
        local = master.chunk(self.tp_size, dim=self.split_axis(factor))[self.tp_rank]
        return local.to(device=device, dtype=dtype).contiguous()

    def _norm_weight(self, device) -> torch.nn.Parameter:
        """γ of the fused RMSNorm, [d] split as the table's NORM_WEIGHT entry says (boost:
        sharded like the hidden stream it scales, [d/t])."""
        split = tensor_split(self.mode, Tensor.NORM_WEIGHT)
        width = self.input_size // self.tp_size if split == 0 else self.input_size
        gamma = torch.nn.Parameter(torch.ones(width, device=device,
                                              dtype=self.config.params_dtype))
        if split is not None:
            set_tensor_model_parallel_attributes(gamma, True, split, 1)
        return gamma

    def _check_divisible(self):
        """Every size the placement table splits divides by the TP size (boost: d_in and
        d_out; naive: the ranks)."""
        entry = placement(self.mode, self.group)
        split = {(f.rows, f.cols)[f.split] for f in (entry.a, entry.b)}
        sizes = {Dim.D_IN: [("input size", self.input_size)],
                 Dim.D_OUT: [(f"output size of '{p.name}'", p.d_out)
                             for p in self.projections],
                 Dim.RANK: [(f"rank of '{p.name}'", p.rank) for p in self.projections]}
        check_divisible_by_tp(self.tp_size, [(f"{type(self).__name__}: {what}", size,
                                               "this layer's split")
                                              for dim in Dim if dim in split
                                              for what, size in sizes[dim]], self.mode)

    def factors(self, which) -> List[torch.Tensor]:
        """The local factors of the projections, in order: the row views of the grouped A
        ([local r_p, local d_in] each) or B ([local d_out_p, local r_p]); ``which``: a
        :class:`WeightFactor` or its name."""
        factor = WeightFactor(which)
        return list(getattr(self, factor.value).split(self._local_rows(factor), dim=0))

    def outputs(self, outs: Sequence[torch.Tensor]):
        """The group's result: the one projection's output, or the tuple of every projection's
        output (q, k, v; gate, up), which the model's attention and MLP take as they are
        (``model/blocks.py``), without laying them out in one tensor."""
        return outs[0] if len(outs) == 1 else tuple(outs)

    # -- checkpointing ---------------------------------------------------------------------

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Global tensors named A_<p>, B_<p> (and layer_norm_weight), with global shapes that do
        not depend on the mode or the TP size; only the sharding axis differs. Each grouped
        factor is saved as its per-projection pieces through a ShardedTensorFactory, as
        megatron saves its fused gated fc1 (split when saving, concatenated when loading)."""
        state = self.state_dict(prefix="", keep_vars=True)
        grouped = {factor: state.pop(factor.value) for factor in WeightFactor}
        norm_split = tensor_split(self.mode, Tensor.NORM_WEIGHT)
        axis_map = ({"layer_norm_weight": norm_split}
                    if self.fuse_norm and norm_split is not None else {})
        dp_cp_group = (metadata or {}).get("dp_cp_group")
        if dp_cp_group is None:
            dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        sd = make_sharded_tensors_for_checkpoint(
            state, prefix, axis_map, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=dp_cp_group)
        for factor, tensor in grouped.items():
            key = f"{prefix}{factor.value}"
            sd[key] = self._grouped_factory(factor, key, tensor, sharded_offsets, dp_cp_group)
        return sd

    def _grouped_factory(self, factor: WeightFactor, key: str, grouped: torch.Tensor,
                         sharded_offsets, dp_cp_group) -> ShardedTensorFactory:
        """A grouped factor ([Σ rows, cols]) as the ShardedTensors ``<key>_<p>`` (A_q, A_k,
        ...; B_q, ...; the optimizer's state prefixes ``key``), each sharded along the
        factor's axis."""
        names, rows = [p.name for p in self.projections], self._local_rows(factor)
        axis = self.split_axis(factor)

        def sharded(key_p, tensor, replica_id=None):
            return make_tp_sharded_tensor_for_checkpoint(
                tensor, key_p, axis, replica_id=replica_id, prepend_offsets=sharded_offsets,
                tp_group=self.tp_group, dp_cp_group=dp_cp_group)

        @torch.no_grad()
        def build(key, t, replica_id, flattened_range):
            if flattened_range is not None:
                raise NotImplementedError("flattened ranges of the grouped factors")
            return [sharded(f"{key}_{name}", piece, replica_id)
                    for name, piece in zip(names, t.split(rows, dim=0))]

        def merge(pieces):
            with torch.no_grad():
                return torch.cat(pieces, dim=0)  # [Σ local rows, local cols]

        return ShardedTensorFactory(key, grouped, build, merge,
                                    replica_id=sharded(key, grouped).replica_id)


class BoostBottleneckGroup(BottleneckGroup):
    """boost: sharded input -> partial A products -> all-reduce(Σr [+1]) -> σ -> sharded B.

    Input  x: [s, b, d_in/t] (hidden-, head- or ffn-sharded).
    Output: each projection's local rows [s, b, d_out_p/t] (:meth:`outputs`).

    With ``fuse_norm`` the layer computes B·σ(A·RMSNorm(x)) exactly, although no rank holds the
    whole of x: RMSNorm only rescales each token, so A·(γ⊙x/rms) = ((A⊙γ)·x)/rms. Each rank
    adds its partial sum of squares Σ x_k² to the SAME all-reduce (online-RMSNorm, BOOST
    section 4; in bf16 its fp32 all-reduce of its own runs during the A GEMM), and 1/rms is
    applied after it, fused with σ (docs/design.md §3). At t = 1 there is nothing to gather:
    the norm is a plain fused RMSNorm in front of the GEMM.
    """

    mode = TPMode.BOOST
    batched_up = False
    """One batched GEMM for the B factors (equal shapes): only where the consumer keeps every
    output, since the outputs share one buffer (``BottleneckGeometry.batched``)."""

    def __init__(self, config: BoostTransformerConfig, input_size: int,
                 projections: Sequence[Projection], tp_group):
        super().__init__(config, input_size, projections, tp_group)
        name = config.bottleneck_activation
        act_grad = get_bottleneck_activation_grad(name)
        self._activation = BottleneckActivation(
            act=self.activation,
            act_grad=act_grad or autograd_activation_grad(self.activation),
            identity=is_identity(name), hidden_size=input_size, eps=self.eps)

    def forward(self, x: torch.Tensor):
        x_in, w, with_statistic = self._a_side(x)
        geometry = self._geometry()
        if self.config.bottleneck_overlap_chunks > 1:  # one pipeline over blocks of tokens
            return self.outputs(pipelined_bottleneck(x_in, w, self.B,
                                                     self._plan(geometry, with_statistic),
                                                     self._offered_residual(x_in, geometry)))
        # [s, b, Σr] and the fp32 [s, b, 1] sum of squares (None unless the fused norm
        # gathers it), complete on every rank: ONE GEMM for the group's A factors and ONE
        # all-reduce of the partial products; fwd AR(Σr (+1)), bwd identity (then the GEMMs'
        # backward). Low-rank activation checkpointing serves both from its log, inside
        # down_project (docs/design.md §7).
        # An interleaved half's backward reduces dP after σ' and waits in the A side (link).
        link = GradientLink() if in_half() else None
        reduced = down_project(x_in, w, self.tp_group, with_statistic, geometry.fuse_wgrad, link)
        products, sumsq = reduced if with_statistic else (reduced, None)
        # scale and σ, then the B factors (+ the residual: proj, fc2); bwd: AR(Σr) of dz,
        # overlapped with dB.
        residual = self._offered_residual(products, geometry)
        return self.outputs(up_project(products, sumsq, self.B, geometry, link, residual))

    def _offered_residual(self, tokens: torch.Tensor, geometry: BottleneckGeometry):
        """The layer's residual [s, b, d/t] for the B GEMM of the block's output (proj, fc2)
        to add, as the residual tap offered it (``parallel/residual.py``); else None.
        ``tokens``: any [s, b, ...] tensor of the group's (its input, its products)."""
        group = getattr(type(self), "group", None)
        if group is None or not group.writes_residual:
            return None
        return take_offered_residual((*tokens.shape[:-1], geometry.rows[0]), tokens.dtype)

    def _geometry(self) -> BottleneckGeometry:
        """The group's B side besides its tensors (``parallel/bottleneck.py``)."""
        return BottleneckGeometry(
            group=self.tp_group, rows=tuple(self._local_rows(WeightFactor.B)),
            ranks=tuple(self._latent_widths()), activation=self._activation,
            overlap=self.config.overlap_bottleneck_grad_reduce, batched=self.batched_up,
            fuse_wgrad=self.config.bottleneck_grad_accumulation_fusion)

    def _a_side(self, x: torch.Tensor):
        """(input, factor, whether the statistic is gathered) of the group's A GEMM. With the
        fused norm on hidden shards, A is scaled by γ (weight-sized) and online-RMSNorm's fp32
        statistic rides with the products (``parallel/online_rmsnorm.py``); on the whole hidden
        vector (t = 1) there is nothing to gather: a plain fused RMSNorm before the GEMM."""
        if not self.fuse_norm:
            return x, self.A, False
        if not self._stream_is_sharded():
            return F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps), self.A, False
        folded = fold_norm_weight(self.A, self.layer_norm_weight,
                                  self.config.bottleneck_grad_accumulation_fusion)
        return x, folded, True  # [Σr, d/t]

    def _plan(self, geometry: BottleneckGeometry, with_statistic: bool) -> PipelinePlan:
        """``parallel.bottleneck_overlap_chunks`` > 1: the group's pipeline
        (``parallel/pipeline.py``)."""
        return PipelinePlan(geometry=geometry, chunks=self.config.bottleneck_overlap_chunks,
                            with_statistic=with_statistic)


class NaiveBottleneckGroup(BottleneckGroup):
    """naive: replicated input -> column-parallel A (r/t) -> σ -> row-parallel B -> all-reduce.

    Input  x: [s, b, d_in] replicated.  Output: [s, b, Σ d_out] replicated.
    """

    mode = TPMode.NAIVE

    def forward(self, x: torch.Tensor):
        h = self.activation(self._column_parallel_a(x))  # [s, b, Σr/t]
        # [s, b, Σ d_out], partial over ranks until the all-reduce (contiguous: a fresh GEMM or
        # concatenation output, as megatron's in-place all-reduce requires); one collective for
        # the group, so its projections are laid side by side first
        out = reduce_forward(self._row_parallel_b(h),
                             self.tp_group)  # fwd: AR(Σ d_out); bwd: identity
        if len(self.projections) == 1:
            return out
        return self.outputs(out.split([p.d_out for p in self.projections], dim=-1))

    def _main_grad(self, factor: WeightFactor, dtype) -> Optional[torch.Tensor]:
        """The factor's main_grad when its weight-gradient GEMM accumulates into it
        (``parallel/wgrad.py``), else None."""
        return accumulation_target(getattr(self, factor.value),
                                   self.config.bottleneck_grad_accumulation_fusion, dtype)

    def _row_parallel_b(self, h: torch.Tensor) -> torch.Tensor:
        """The projections' B GEMMs side by side, [s, b, Σ d_out]: each writing its columns of
        one buffer, dB accumulated in B's main_grad, with the fusion; else one GEMM per
        projection and their concatenation."""
        ranks = self._latent_widths()  # r_p/t each
        main_grad = self._main_grad(WeightFactor.B, h.dtype)
        if main_grad is not None:
            return row_parallel_b(h, self.B, main_grad, self._local_rows(WeightFactor.B), ranks)
        outs = split_project(h, self.factors(WeightFactor.B), ranks)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def _column_parallel_a(self, x: torch.Tensor) -> torch.Tensor:
        """x · A_local^T on the replicated input: megatron's column-parallel linear. bwd:
        AR(d_in) of dx, overlapped with the dA GEMM when ``overlap_bottleneck_grad_reduce``,
        else issued first as in the plain autograd graph; with the gradient accumulation
        fusion, dA accumulates in A's main_grad (``parallel/wgrad.py``)."""
        a = self.A  # [Σr/t, d_in]
        main_grad = self._main_grad(WeightFactor.A, x.dtype)
        if main_grad is not None:
            return column_parallel_a(x, a, main_grad, self.tp_group,
                                     self.config.overlap_bottleneck_grad_reduce)
        if not self.config.overlap_bottleneck_grad_reduce:
            return torch.matmul(copy_to_tensor_model_parallel_region(x, group=self.tp_group),
                                a.t())
        return linear_with_dgrad_allreduce(x, a, self.tp_group, allreduce_dgrad=self.tp_size > 1)


# ---------------------------------------------------------------------------------------------
# megatron-core layer-spec slots
# ---------------------------------------------------------------------------------------------


def _qkv_projections(config, input_size, output_size) -> List[Projection]:
    """q, k, v of one attention layer: ``linear_qkv`` returns the three as they come out of
    their B factors, [s, b, np/t·hn], [s, b, ng/t·hn], [s, b, ng/t·hn] (query heads in
    megatron's order: a group's np/ng heads together), and ``BottleneckSelfAttention``
    (``model/blocks.py``) views them as heads, with no fused-layout concatenation."""
    hn = config.kv_channels
    ng = config.num_query_groups or config.num_attention_heads
    q_out, kv_out = config.num_attention_heads * hn, ng * hn
    if output_size != q_out + 2 * kv_out:
        raise ValueError(f"linear_qkv output_size ({output_size}) must equal heads·hn + "
                         f"2·groups·hn ({q_out + 2 * kv_out})")
    r = config.attn_rank
    return [Projection("q", input_size, q_out, r), Projection("k", input_size, kv_out, r),
            Projection("v", input_size, kv_out, r)]


def _fc1_projections(config, input_size, output_size) -> List[Projection]:
    ffn = output_size // 2
    if output_size != 2 * config.ffn_hidden_size:
        raise ValueError(f"linear_fc1 output_size ({output_size}) must be 2·ffn_hidden_size "
                         f"({2 * config.ffn_hidden_size}): the MLP is gated (gate, up)")
    # MLP chunks the local output in two: [gate_local; up_local], which concat gives.
    return [Projection("gate", input_size, ffn, config.mlp_rank),
            Projection("up", input_size, ffn, config.mlp_rank)]


def _slot_projections(config, group: Group, input_size, output_size) -> List[Projection]:
    """The projections of a slot's group; a row group (proj: o, fc2: down) has one, at its
    group's rank."""
    if group is Group.QKV:
        return _qkv_projections(config, input_size, output_size)
    if group is Group.FC1:
        return _fc1_projections(config, input_size, output_size)
    rank = config.attn_rank if group.rank_kind == "attn" else config.mlp_rank
    return [Projection(GROUP_PROJECTIONS[group][0], input_size, output_size, rank)]


class _LinearSlot:
    """megatron-core's constructor contract of a linear slot (docs/design.md §10.7): called as
    megatron calls ``linear_qkv`` / ``linear_fc1`` (``gather_output``) and ``linear_proj`` /
    ``linear_fc2`` (``input_is_parallel``), returning ``(output, None)``: no bias.

    Naive slots run attention and the MLP on replicated tensors, so the module that builds
    them believes TP=1 (its ``tp_group`` has one rank). The bottleneck's own TP group comes
    from the layer spec as ``bottleneck_tp_group``; without it ``tp_group`` is used (a layer
    built on its own, as in the layer tests; boost's spec never passes one)."""

    group: Group

    def __init__(self, input_size, output_size, *, config, init_method=None, bias=False,
                 skip_bias_add=False, is_expert=False, tp_comm_buffer_name=None,
                 tp_group=None, bottleneck_tp_group=None, **kwargs):
        if bias:
            raise ValueError(f"{type(self).__name__}: bottleneck layers have no bias; set "
                             f"add_bias_linear (and add_qkv_bias) to False")
        group = bottleneck_tp_group if bottleneck_tp_group is not None else tp_group
        super().__init__(config, input_size,
                         _slot_projections(config, self.group, input_size, output_size),
                         group)

    def forward(self, x):
        return super().forward(x), None


_GROUP_CLASSES = {TPMode.BOOST: BoostBottleneckGroup, TPMode.NAIVE: NaiveBottleneckGroup}


def _slot(name: str, mode: TPMode, group: Group, doc: str, **attrs) -> type:
    """THE slot factory: the class megatron's spec puts in ``group``'s linear slot for
    ``mode``, the mode's group class under the slot contract of :class:`_LinearSlot`. Named at
    module level, so the specs import it and it pickles."""
    namespace = {"group": group, "__doc__": doc, "__module__": __name__,
                 "__qualname__": name, **attrs}
    return type(name, (_LinearSlot, _GROUP_CLASSES[mode]), namespace)


BoostLinearQKV = _slot("BoostLinearQKV", TPMode.BOOST, Group.QKV, """boost ``linear_qkv``:
    fused online-RMSNorm + q, k, v bottlenecks. Input [s, b, d/t] hidden-sharded; output
    [s, b, np/t·hn], [s, b, ng/t·hn] twice, head-sharded (attention keeps only v, RoPE replaces
    q and k: one buffer for the three would keep q and k alive, so a GEMM per projection).""")
BoostLinearFC1 = _slot("BoostLinearFC1", TPMode.BOOST, Group.FC1, """boost ``linear_fc1``:
    fused online-RMSNorm + gate, up bottlenecks. Input [s, b, d/t] hidden-sharded; output
    [s, b, f/t] twice (gate, up): the MLP's product keeps both for its backward, so one
    batched GEMM writing one buffer costs no memory.""", batched_up=True)
BoostLinearProj = _slot("BoostLinearProj", TPMode.BOOST, Group.PROJ, """boost ``linear_proj``:
    the o bottleneck (attention rank); head-sharded input [s, b, np/t·hn], hidden-sharded
    output [s, b, d/t] (added to the sharded residual stream).""")
BoostLinearFC2 = _slot("BoostLinearFC2", TPMode.BOOST, Group.FC2, """boost ``linear_fc2``:
    the down bottleneck (MLP rank); ffn-sharded input [s, b, f/t], hidden-sharded output
    [s, b, d/t] (added to the sharded residual stream).""")
NaiveLinearQKV = _slot("NaiveLinearQKV", TPMode.NAIVE, Group.QKV, """naive ``linear_qkv``:
    replicated [s, b, d] in, replicated q, k, v out.""")
NaiveLinearFC1 = _slot("NaiveLinearFC1", TPMode.NAIVE, Group.FC1, """naive ``linear_fc1``:
    replicated [s, b, d] in, replicated gate, up [s, b, f] out.""")
NaiveLinearProj = _slot("NaiveLinearProj", TPMode.NAIVE, Group.PROJ, """naive
    ``linear_proj``: the o bottleneck (attention rank); replicated in, replicated [s, b, d]
    out.""")
NaiveLinearFC2 = _slot("NaiveLinearFC2", TPMode.NAIVE, Group.FC2, """naive ``linear_fc2``:
    the down bottleneck (MLP rank); replicated in, replicated [s, b, d] out.""")
