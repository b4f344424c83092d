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
    the GEMMs and collectives in the autograd Functions of ``parallel/mappings.py``.

naive ("vanilla TP", Megatron's MLP pattern applied to each (A, B) pair):
    A_<p>: [r_p/t, d_in]  sharded along r (dim 0; column-parallel, replicated input)
    B_<p>: [d_out_p, r_p/t] sharded along r (dim 1; row-parallel, all-reduce of the output)
    Forward: all-reduce of the group's output (width Σ d_out); backward: all-reduce of the
    input gradient (width d_in).

The four classes at the bottom obey megatron-core's constructor contract for the linear slots
of a layer spec (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``) and return
``(output, None)``: these layers have no bias. A column slot's output is the tuple of its
projections' outputs ((q, k, v); (gate, up)), which ``BottleneckSelfAttention`` and
``BottleneckMLP`` (``model/blocks.py``) take in place of megatron's fused layouts.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

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
from megatron_boost.config.shape import Projection
from megatron_boost.config.transformer import (BoostTransformerConfig, get_bottleneck_activation,
                                               get_bottleneck_activation_grad, is_identity)
from megatron_boost.parallel.mappings import (
    BottleneckActivation,
    bottleneck_up,
    copy_to_tensor_model_parallel_region,
    reduce_forward,
    reduce_products,
    split_project,
)
from megatron_boost.parallel.online_rmsnorm import autograd_activation_grad, fold_norm_weight
from megatron_boost.parallel.pipeline import PipelinePlan, pipelined_bottleneck
from megatron_boost.parallel.wgrad import accumulation_target, column_parallel_a, row_parallel_b
from megatron_boost.config.placement import GROUP_PROJECTIONS, Dim, Group, Norm, placement

__all__ = [
    "cola_std",
    "cola_init_",
    "BottleneckGroup",
    "BoostBottleneckGroup",
    "NaiveBottleneckGroup",
    "BoostLinearQKV",
    "BoostLinearFC1",
    "BoostLinearRow",
    "BoostLinearProj",
    "BoostLinearFC2",
    "NaiveLinearQKV",
    "NaiveLinearFC1",
    "NaiveLinearRow",
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


class BottleneckGroup(MegatronModule):
    """A group of bottleneck projections y_p = B_p·σ(A_p·x) sharing one input.

    Subclasses fix the mode and the group, and write the forward; the sharding (``_a_axis``,
    ``_b_axis``) and whether the input norm is fused come from the placement table
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

    @property
    def _a_axis(self) -> int:
        return placement(self.mode, self.group).a.split

    @property
    def _b_axis(self) -> int:
        return placement(self.mode, self.group).b.split

    def __init__(self, config: BoostTransformerConfig, input_size: int,
                 projections: Sequence[Projection], tp_group):
        super().__init__(config=config)
        self.input_size = input_size
        self.projections = list(projections)
        self.tp_group = tp_group
        self.tp_size = get_pg_size(tp_group)
        self.tp_rank = get_pg_rank(tp_group)
        self.activation = get_bottleneck_activation(config.bottleneck_activation)
        fuse_norm = self.fuse_norm = placement(self.mode, self.group).norm is Norm.FUSED
        self.eps = config.layernorm_epsilon
        self._check_divisible()
        device = (torch.device("cpu") if config.use_cpu_initialization
                  or not torch.cuda.is_available() else torch.cuda.current_device())
        # Local rows of each projection's factor in the grouped A and the grouped B: boost
        # shards d_in and d_out, so A's rows (r) are whole and B's (d_out) split; naive shards
        # the rank, so A's rows are split and B's whole.
        self._a_rows = [p.rank if self._a_axis == 1 else p.rank // self.tp_size
                        for p in self.projections]
        self._b_rows = [p.d_out // self.tp_size if self._b_axis == 0 else p.d_out
                        for p in self.projections]
        a_shards, b_shards = [], []
        for p in self.projections:  # drawn in the order A_p, B_p (same seed, same weights)
            a_shards.append(self._initial_shard(p.rank, input_size, self._a_axis,
                                                config.init_method, p, device))
            b_shards.append(self._initial_shard(p.d_out, p.rank, self._b_axis,
                                                config.output_layer_init_method, p, device))
        # Each factor of the group stored as ONE parameter, the projections' factors stacked by
        # rows: A [Σ local r, local d_in], B [Σ local d_out, local r] (a group shares one
        # rank). The A GEMM reads A as it is; the B GEMMs read row views of B, one batched
        # GEMM when the projections have equal shapes (docs/design.md §4). Checkpoints still
        # hold A_<p>, B_<p> (sharded_state_dict); factors("A"), factors("B") are the row views.
        self.A = self._grouped_parameter(a_shards, self._a_axis)
        self.B = self._grouped_parameter(b_shards, self._b_axis)
        if fuse_norm:
            # γ of the fused RMSNorm, sharded like the hidden stream it scales.
            gamma = torch.ones(input_size // self.tp_size, device=device,
                               dtype=config.params_dtype)
            self.layer_norm_weight = torch.nn.Parameter(gamma)
            set_tensor_model_parallel_attributes(self.layer_norm_weight, True, 0, 1)

    # -- helpers ---------------------------------------------------------------------------

    @staticmethod
    def _grouped_parameter(shards: List[torch.Tensor], axis: int) -> torch.nn.Parameter:
        param = torch.nn.Parameter(torch.cat(shards, dim=0) if len(shards) > 1 else shards[0])
        set_tensor_model_parallel_attributes(param, is_parallel=True, dim=axis, stride=1)
        return param

    def _rows(self, which: str) -> List[int]:
        return self._a_rows if which == "A" else self._b_rows

    def _initial_shard(self, rows: int, cols: int, axis: int, init, p: Projection,
                       device) -> torch.Tensor:
        """This rank's shard of a factor with global shape [rows, cols]: drawn as the global
        master and sliced, or left uninitialised without megatron's ``perform_initialization``
        (the layout-independent init then writes it, docs/design.md §8)."""
        dtype = self.config.params_dtype
        if not self.config.perform_initialization:
            shape = [rows, cols]
            shape[axis] //= self.tp_size
            return torch.empty(shape, device=device, dtype=dtype)
        master = torch.empty(rows, cols, dtype=torch.float32)
        if self.config.cola_init:
            cola_init_(master, p.rank, self.input_size, p.d_out)
        else:
            init(master)
        local = master.chunk(self.tp_size, dim=axis)[self.tp_rank]
        return local.to(device=device, dtype=dtype).contiguous()

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

    def factors(self, which: str) -> List[torch.Tensor]:
        """The local factors of the projections, in order: the row views of the grouped A
        ([local r_p, local d_in] each) or B ([local d_out_p, local r_p])."""
        return list(getattr(self, which).split(self._rows(which), dim=0))

    def local(self, name: str, grad: bool = False) -> Optional[torch.Tensor]:
        """This rank's tensor of a global parameter name (A_<p>, B_<p>, layer_norm_weight),
        or its gradient: A_<p>, B_<p> are their rows of the grouped factor."""
        which = name[0]
        if not name.startswith(("A_", "B_")):
            param = getattr(self, name)
            return param.grad if grad else param
        grouped = getattr(self, which)
        source = grouped.grad if grad else grouped
        if source is None:
            return None
        i = [f"{which}_{p.name}" for p in self.projections].index(name)
        return source.split(self._rows(which), dim=0)[i]

    def axis_of(self, name: str) -> int:
        """The axis along which a global parameter (A_<p>, B_<p>, layer_norm_weight) is
        sharded over the TP group."""
        if name.startswith("A_"):
            return self._a_axis
        return self._b_axis if name.startswith("B_") else 0  # γ: sharded like the hidden

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
        grouped = {which: state.pop(which) for which in ("A", "B")}
        axis_map = {"layer_norm_weight": 0} if self.fuse_norm else {}
        dp_cp_group = (metadata or {}).get("dp_cp_group")
        if dp_cp_group is None:
            dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        sd = make_sharded_tensors_for_checkpoint(
            state, prefix, axis_map, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=dp_cp_group)
        for which, tensor in grouped.items():
            sd[f"{prefix}{which}"] = self._grouped_factory(which, f"{prefix}{which}", tensor,
                                                           sharded_offsets, dp_cp_group)
        return sd

    def _grouped_factory(self, which: str, key: str, grouped: torch.Tensor, sharded_offsets,
                         dp_cp_group) -> ShardedTensorFactory:
        """A grouped factor ([Σ rows, cols]) as the ShardedTensors ``<key>_<p>`` (A_q, A_k,
        ...; B_q, ...; the optimizer's state prefixes ``key``), each sharded along the
        factor's axis."""
        names, rows = [p.name for p in self.projections], self._rows(which)
        axis = self._a_axis if which == "A" else self._b_axis

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
    output, since the outputs share one buffer (``bottleneck_up``)."""

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
        if self.config.bottleneck_overlap_chunks > 1:  # one pipeline over blocks of tokens
            return self.outputs(pipelined_bottleneck(x_in, w, self.B, self._plan(with_statistic)))
        # [s, b, Σr] and the fp32 [s, b, 1] sum of squares (None unless the fused norm
        # gathers it), complete on every rank: ONE GEMM for the group's A factors and ONE
        # all-reduce of the partial products; fwd AR(Σr (+1)), bwd identity (then the GEMMs'
        # backward). Low-rank activation checkpointing serves both from its log, through the
        # mappings (docs/design.md §7).
        fuse = self.config.bottleneck_grad_accumulation_fusion
        products, sumsq = (reduce_products(x_in, w, self.tp_group, True, fuse)
                           if with_statistic
                           else (reduce_products(x_in, w, self.tp_group, False, fuse), None))
        # scale and σ, then the B factors; bwd: AR(Σr) of dz, overlapped with dB.
        return self.outputs(bottleneck_up(
            products, sumsq, self.B, self._b_rows, [p.rank for p in self.projections],
            self.tp_group, self._activation, self.config.overlap_bottleneck_grad_reduce,
            batched=self.batched_up, fuse_wgrad=fuse))

    def _a_side(self, x: torch.Tensor):
        """(input, factor, whether the statistic is gathered) of the group's A GEMM. With the
        fused norm at t > 1, A is scaled by γ (weight-sized) and online-RMSNorm's fp32
        statistic rides with the products (``parallel/online_rmsnorm.py``); at t = 1 the whole
        hidden vector is here: a plain fused RMSNorm in front of the GEMM."""
        if not self.fuse_norm:
            return x, self.A, False
        if self.tp_size == 1:
            return F.rms_norm(x, (x.shape[-1],), self.layer_norm_weight, self.eps), self.A, False
        folded = fold_norm_weight(self.A, self.layer_norm_weight,
                                  self.config.bottleneck_grad_accumulation_fusion)
        return x, folded, True  # [Σr, d/t]

    def _plan(self, with_statistic: bool) -> PipelinePlan:
        """``parallel.bottleneck_overlap_chunks`` > 1: the group's pipeline
        (``parallel/pipeline.py``)."""
        ranks = [p.rank for p in self.projections]
        shared = self.batched_up and len(set(self._b_rows)) == 1 and len(set(ranks)) == 1
        return PipelinePlan(
            group=self.tp_group, chunks=self.config.bottleneck_overlap_chunks,
            rows=tuple(self._b_rows), ranks=tuple(ranks), activation=self._activation,
            with_statistic=with_statistic,
            overlap_backward=self.config.overlap_bottleneck_grad_reduce, shared_output=shared,
            fuse_wgrad=self.config.bottleneck_grad_accumulation_fusion)


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

    def _main_grad(self, which: str, dtype) -> Optional[torch.Tensor]:
        """The factor's main_grad when its weight-gradient GEMM accumulates into it
        (``parallel/wgrad.py``), else None."""
        return accumulation_target(getattr(self, which),
                                   self.config.bottleneck_grad_accumulation_fusion, dtype)

    def _row_parallel_b(self, h: torch.Tensor) -> torch.Tensor:
        """The projections' B GEMMs side by side, [s, b, Σ d_out]: each writing its columns of
        one buffer, dB accumulated in B's main_grad, with the fusion; else one GEMM per
        projection and their concatenation."""
        ranks = [p.rank // self.tp_size for p in self.projections]
        main_grad = self._main_grad("B", h.dtype)
        if main_grad is not None:
            return row_parallel_b(h, self.B, main_grad, self._b_rows, ranks)
        outs = split_project(h, self.factors("B"), ranks)
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def _column_parallel_a(self, x: torch.Tensor) -> torch.Tensor:
        """x · A_local^T on the replicated input: megatron's column-parallel linear. bwd:
        AR(d_in) of dx, overlapped with the dA GEMM when ``overlap_bottleneck_grad_reduce``,
        else issued first as in the plain autograd graph; with the gradient accumulation
        fusion, dA accumulates in A's main_grad (``parallel/wgrad.py``)."""
        a = self.A  # [Σr/t, d_in]
        main_grad = self._main_grad("A", x.dtype)
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


def _reject_bias(bias: bool, cls_name: str):
    if bias:
        raise ValueError(f"{cls_name}: bottleneck layers have no bias; set add_bias_linear "
                         f"(and add_qkv_bias) to False")


class _QKVMixin:
    """q, k, v of one attention layer: ``linear_qkv`` returns the three as they come out of
    their B factors, [s, b, np/t·hn], [s, b, ng/t·hn], [s, b, ng/t·hn] (query heads in
    megatron's order: a group's np/ng heads together), and ``BottleneckSelfAttention``
    (``model/blocks.py``) views them as heads, with no fused-layout concatenation."""

    def _qkv_projections(self, config, input_size, output_size):
        hn = config.kv_channels
        ng = config.num_query_groups or config.num_attention_heads
        q_out, kv_out = config.num_attention_heads * hn, ng * hn
        if output_size != q_out + 2 * kv_out:
            raise ValueError(f"linear_qkv output_size ({output_size}) must equal heads·hn + "
                             f"2·groups·hn ({q_out + 2 * kv_out})")
        r = config.attn_rank
        return [Projection("q", input_size, q_out, r), Projection("k", input_size, kv_out, r),
                Projection("v", input_size, kv_out, r)]



def _fc1_projections(config, input_size, output_size):
    ffn = output_size // 2
    if output_size != 2 * config.ffn_hidden_size:
        raise ValueError(f"linear_fc1 output_size ({output_size}) must be 2·ffn_hidden_size "
                         f"({2 * config.ffn_hidden_size}): the MLP is gated (gate, up)")
    # MLP chunks the local output in two: [gate_local; up_local], which concat gives.
    return [Projection("gate", input_size, ffn, config.mlp_rank),
            Projection("up", input_size, ffn, config.mlp_rank)]


def _row_projection(config, group: Group, input_size, output_size):
    """The one projection of a row group (proj: o, fc2: down), at its group's rank."""
    rank = config.attn_rank if group.rank_kind == "attn" else config.mlp_rank
    return [Projection(GROUP_PROJECTIONS[group][0], input_size, output_size, rank)]


class BoostLinearQKV(_QKVMixin, BoostBottleneckGroup):
    """boost ``linear_qkv``: fused online-RMSNorm + q, k, v bottlenecks.

    Input [s, b, d/t] hidden-sharded; output [s, b, ng/t·(np/ng + 2)·hn] head-sharded.
    """

    group = Group.QKV

    def __init__(self, input_size, output_size, *, config, init_method=None,
                 gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
                 tp_comm_buffer_name=None, tp_group=None, **kwargs):
        _reject_bias(bias, type(self).__name__)
        super().__init__(config, input_size,
                         self._qkv_projections(config, input_size, output_size), tp_group)

    def forward(self, x):
        return super().forward(x), None


class BoostLinearFC1(BoostBottleneckGroup):
    """boost ``linear_fc1``: fused online-RMSNorm + gate, up bottlenecks.

    Input [s, b, d/t] hidden-sharded; output [s, b, 2·f/t] = [gate_local; up_local].
    """

    group = Group.FC1
    # The MLP's product keeps gate and up for its backward, so one buffer for both costs no
    # memory. (Attention keeps only v, RoPE replaces q and k: one buffer for q, k, v would
    # keep q and k alive, so linear_qkv runs a GEMM per projection.)
    batched_up = True

    def __init__(self, input_size, output_size, *, config, init_method=None,
                 gather_output=False, bias=False, skip_bias_add=True, is_expert=False,
                 tp_comm_buffer_name=None, tp_group=None, **kwargs):
        _reject_bias(bias, type(self).__name__)
        super().__init__(config, input_size, _fc1_projections(config, input_size, output_size),
                         tp_group)

    def forward(self, x):
        return super().forward(x), None


class BoostLinearRow(BoostBottleneckGroup):
    """boost ``linear_proj`` / ``linear_fc2``: head- or ffn-sharded input [s, b, in/t],
    hidden-sharded output [s, b, d/t] (added to the sharded residual stream). The group, and
    so the rank, is the subclass's: :class:`BoostLinearProj`, :class:`BoostLinearFC2`."""

    def __init__(self, input_size, output_size, *, config, init_method=None, bias=False,
                 input_is_parallel=True, skip_bias_add=True, is_expert=False,
                 tp_comm_buffer_name=None, tp_group=None, **kwargs):
        _reject_bias(bias, type(self).__name__)
        super().__init__(config, input_size,
                         _row_projection(config, self.group, input_size, output_size), tp_group)

    def forward(self, x):
        return super().forward(x), None


class BoostLinearProj(BoostLinearRow):
    """boost ``linear_proj``: the o bottleneck (attention rank)."""

    group = Group.PROJ


class BoostLinearFC2(BoostLinearRow):
    """boost ``linear_fc2``: the down bottleneck (MLP rank)."""

    group = Group.FC2


class _NaiveSlot:
    """Naive slots run attention and the MLP on replicated tensors, so the module that builds
    them believes TP=1 (its ``tp_group`` has one rank). The bottleneck's own TP group comes
    from the layer spec as ``bottleneck_tp_group``; without it ``tp_group`` is used (a layer
    built on its own, as in the layer tests)."""

    @staticmethod
    def _group(tp_group, bottleneck_tp_group):
        return bottleneck_tp_group if bottleneck_tp_group is not None else tp_group


class NaiveLinearQKV(_QKVMixin, _NaiveSlot, NaiveBottleneckGroup):
    """naive ``linear_qkv``: replicated [s, b, d] in, replicated fused qkv [s, b, 3d (MHA)] out."""

    group = Group.QKV

    def __init__(self, input_size, output_size, *, config, init_method=None,
                 gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
                 tp_comm_buffer_name=None, tp_group=None, bottleneck_tp_group=None, **kwargs):
        _reject_bias(bias, type(self).__name__)
        super().__init__(config, input_size,
                         self._qkv_projections(config, input_size, output_size),
                         self._group(tp_group, bottleneck_tp_group))

    def forward(self, x):
        return super().forward(x), None


class NaiveLinearFC1(_NaiveSlot, NaiveBottleneckGroup):
    """naive ``linear_fc1``: replicated [s, b, d] in, replicated [s, b, 2f] = [gate; up] out."""

    group = Group.FC1

    def __init__(self, input_size, output_size, *, config, init_method=None,
                 gather_output=False, bias=False, skip_bias_add=True, is_expert=False,
                 tp_comm_buffer_name=None, tp_group=None, bottleneck_tp_group=None, **kwargs):
        _reject_bias(bias, type(self).__name__)
        super().__init__(config, input_size, _fc1_projections(config, input_size, output_size),
                         self._group(tp_group, bottleneck_tp_group))

    def forward(self, x):
        return super().forward(x), None


class NaiveLinearRow(_NaiveSlot, NaiveBottleneckGroup):
    """naive ``linear_proj`` / ``linear_fc2``: replicated in, replicated [s, b, d] out. The
    group is the subclass's: :class:`NaiveLinearProj`, :class:`NaiveLinearFC2`."""

    def __init__(self, input_size, output_size, *, config, init_method=None, bias=False,
                 input_is_parallel=True, skip_bias_add=True, is_expert=False,
                 tp_comm_buffer_name=None, tp_group=None, bottleneck_tp_group=None, **kwargs):
        _reject_bias(bias, type(self).__name__)
        super().__init__(config, input_size,
                         _row_projection(config, self.group, input_size, output_size),
                         self._group(tp_group, bottleneck_tp_group))

    def forward(self, x):
        return super().forward(x), None


class NaiveLinearProj(NaiveLinearRow):
    """naive ``linear_proj``: the o bottleneck (attention rank)."""

    group = Group.PROJ


class NaiveLinearFC2(NaiveLinearRow):
    """naive ``linear_fc2``: the down bottleneck (MLP rank)."""

    group = Group.FC2
