"""Analytical GPU-cluster performance model for full / naive / boost training.

Predicts, for one training iteration of a LLaMA-style decoder (full-rank, or CoLA bottleneck
``y = B·σ(A·x)`` in every projection) under Megatron-style 3D parallelism:

* the iteration time (GEMMs, attention core, memory-bound element-wise kernels, kernel launch
  gaps, TP collectives, recompute, pipeline bubble and p2p, exposed DP gradient reduction,
  optimizer step),
* the per-GPU memory (weights, gradients, Adam states, activations under the recompute policy,
  logits),
* the communication volumes (TP elements per token per layer forward/backward, DP gradient
  bytes, PP p2p bytes).

The three TP modes follow docs/design.md §2 (widths of the TP collectives: §5):

``full``   full-rank model, Megatron TP: column-parallel qkv/fc1, row-parallel proj/fc2; the
           residual stream, both RMSNorms and the residual adds are replicated on every TP rank;
           per layer 2 all-reduces of d forward and 2 backward. With megatron's sequence
           parallelism (``Layout.sequence_parallel``; resolved as the trainer does: on for full
           at TP > 1) the residual stream, norms and residual adds are sharded along the
           sequence (÷ t, saved activations included) and each all-reduce is a reduce-scatter
           plus an all-gather of the same d-wide bytes (backward also re-gathers the qkv / fc1
           input for the weight gradient: 4 half-collectives forward, 6 backward).
``naive``  bottleneck model, every (A, B) pair is one Megatron chunk: A column-parallel (local
           rank r/t), σ on the local slice, B row-parallel + all-reduce of the full output. The
           attention core, RoPE, SwiGLU, norms and residual adds run on full tensors, replicated
           on every TP rank (NOT divided by t). Forward all-reduces (q+2kv) + d + 2f + d
           (= 5d + 2f for MHA), backward d + (h·e) + d + f (= 3d + f for MHA); 8 collectives.
``boost``  bottleneck model with the residual stream sharded along d: A row-sharded (K = in/t),
           all-reduce of the r-wide partial product (+1 rms partial sum for the normed groups),
           σ, B column-sharded (N = out/t). Everything is divided by t except the r-wide
           bottleneck activations. Forward 7r + 2, backward 7r; 8 collectives.

The cost of each kernel, collective, pipeline phase, recompute policy and memory term is
described in docs/performance.md ("The cost model").

``mfu`` counts model FLOPs as the trainer does (``analysis/flops.py``, megatron-LM's
convention): 6 per projection parameter per token (layers + LM head) plus the causal attention
core (half the s×s square), backward = 2 × forward; naive's duplicated work is not counted.

The widths (d, f, heads, ranks, parameters per projection) all come from the one
:class:`~megatron_boost.config.shape.ModelShape` (what a layer moves, launches and keeps
from its op ledger, measured once per shape and layout), the TP collective widths from
:func:`~megatron_boost.analysis.comm.tp_collectives` (the embedding's, tied or not, from
:func:`~megatron_boost.analysis.comm.embedding_collectives`), the per-GPU GEMM shapes and
parameters from the placement table
(:func:`~megatron_boost.config.placement.local_factor_shapes`). Every hardware number and
every calibrated efficiency lives in :data:`~megatron_boost.perf.hardware.HARDWARE`; the kernel
costs in :mod:`megatron_boost.perf.kernels`; the authors' published table in
:mod:`megatron_boost.perf.published`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from megatron_boost.analysis.comm import (CROSS_ENTROPY_FP32_VALUES, embedding_collectives,
                                          head_collectives, tp_collectives)
from megatron_boost.analysis.flops import step_flops
from megatron_boost.measure.ledger import (CORE_ATTENTION_SCOPE, LayerLedger, LedgerSpec,
                                            layer_ledger)
from megatron_boost.config.shape import MODES, ModelShape, check_mode
from megatron_boost.config.layout import Layout as ParallelLayout
from megatron_boost.config.modes import TPMode, check_tp_split, resolve_sequence_parallel
from megatron_boost.config.placement import (Dim, Group, Tensor, local_factor_shapes,
                                             local_numel, split_dims)
from megatron_boost.perf.hardware import (BYTES_ACT, BYTES_GRAD, BYTES_OPTIM, BYTES_WEIGHT,
                                          CE_BYTES_BWD, CE_BYTES_FWD,
                                          OPTIMIZER_BYTES_PER_PARAM, HardwareSpec)
from megatron_boost.perf.kernels import (allgather_time, allreduce_time,
                                         attention_time, elementwise_time, gemm_time, p2p_time)

__all__ = ["MODES", "RECOMPUTE", "Layout", "Prediction", "LayerWork", "layer_work",
           "pipeline_time", "predict", "BACKWARD_SHARE_OF_STEP"]

RECOMPUTE = ("none", "selective", "full", "lowrank")
#: The layout's keys in the JSON reports (tools/perf_model.py --json), in their published order.
_LAYOUT_JSON_ORDER = ("mode", "tp", "pp", "dp", "micro_batch", "global_batch", "recompute", "vpp",
                      "distributed_optimizer", "overlap_grad_reduce", "gpus_per_node",
                      "sequence_parallel", "overlap_chunks")

#: Share of one micro-batch's forward + backward time that is backward. Backward costs two
#: matmuls per forward matmul (input and weight gradients: 2× the forward FLOPs), so it is
#: 2/3 of the step; the model uses 0.66 (2/3 rounded down, kept at the value the published
#: comparison was calibrated with). With ``overlap_grad_reduce`` the DP gradient reduction
#: starts as the last micro-batch's backward produces gradients, so at most this much of the
#: busiest stage's time can hide it.
BACKWARD_SHARE_OF_STEP = 0.66


@dataclass(frozen=True)
class Layout(ParallelLayout):
    """The layout record (``config/layout.py``) and the batch and run settings the model prices."""

    dp: int = 1
    vpp: int = 1
    micro_batch: int = 1
    global_batch: Optional[int] = None  # None: micro_batch · dp (one micro-batch per step)
    recompute: str = "none"
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = True
    gpus_per_node: Optional[int] = None  # None: the hardware default
    overlap_chunks: int = 1  # boost: parallel.bottleneck_overlap_chunks
    interleave_halves: bool = False  # boost: parallel.interleave_halves

    def to_dict(self) -> dict:
        """The fields in the order the JSON reports have always listed them (the halves only
        where on)."""
        names = _LAYOUT_JSON_ORDER + (("interleave_halves",) if self.interleave_halves else ())
        return {name: getattr(self, name) for name in names}

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def num_micro_batches(self) -> int:
        gb = self.global_batch or self.micro_batch * self.dp
        m, rem = divmod(gb, self.micro_batch * self.dp)
        if rem or m < 1:
            raise ValueError(f"global batch {gb} is not a multiple of micro-batch "
                             f"{self.micro_batch} × dp {self.dp}")
        return m


# ---------------------------------------------------------------------------------------------
# per-layer work of each mode (per GPU, one micro-batch)
# ---------------------------------------------------------------------------------------------


@dataclass
class Gemm:
    name: str
    N: float   # output width (per GPU)
    K: float   # contraction (per GPU)
    kind: str  # "dense" (full-rank), "A", "B", "head"


@dataclass
class LayerWork:
    """One decoder layer on one GPU: its GEMMs, attention heads, TP collectives and parameters
    from the shape and the placement table; what it moves, launches and keeps for backward from
    the op ledger of the layer as the model builds it (:meth:`ledger`, measured on first use)."""

    gemms: List[Gemm]
    attn_heads: float           # local heads the attention core runs on
    collectives: List[Tuple[str, str, int]]  # (direction, kind, elements per token), TP
    params: float               # parameters per GPU
    ledger_spec: "LedgerSpec"   # the op ledger of this layer, without recompute

    @property
    def coll_fwd(self) -> List[int]:
        """Forward collective widths, elements per token."""
        return [width for direction, _, width in self.collectives if direction == "fwd"]

    @property
    def coll_bwd(self) -> List[int]:
        """Backward collective widths, elements per token."""
        return [width for direction, _, width in self.collectives if direction == "bwd"]

    def ledger(self, recompute: Optional[str] = None) -> "LayerLedger":
        """The op ledger of the layer (``measure/ledger.py``); ``recompute='lowrank'``: with
        low-rank activation checkpointing (its backward holds the recompute)."""
        spec = self.ledger_spec
        if recompute == "lowrank":
            spec = dataclasses.replace(spec, recompute="lowrank")
        return layer_ledger(spec)


def _factor_gemms(shape: ModelShape, mode: TPMode, t: int) -> List[Gemm]:
    """The forward GEMM of every weight factor on one rank: its local [rows, cols] in the
    placement table (``config/placement.py``) gives N = rows (output width) and K = cols
    (contraction). Sizes are divided exactly (floats): the model also prices layouts whose
    sizes the trainer would reject."""
    kinds = {"W": "dense", "A": "A", "B": "B"}
    return [Gemm(name, rows, cols, kinds[name[0]]) for name, (rows, cols) in
            local_factor_shapes(mode, shape.projections(mode), t, divide=lambda n, k: n / k)]


def _local_params(gemms: List[Gemm]) -> float:
    """Projection parameters on one rank: the elements of its local factors."""
    return sum(g.N * g.K for g in gemms)


def layer_work(shape: ModelShape, mode: str, t: int, sequence_parallel: bool = False,
               micro_batch: int = 1, overlap_chunks: int = 1,
               interleave_halves: bool = False) -> LayerWork:
    """GEMMs, collectives, parameters and the op ledger of one decoder layer on one GPU of a
    TP group of ``t`` (docs/design.md §2, §17); sequence parallelism applies to full mode
    only, the pipelined all-reduce (``overlap_chunks``) and the interleaved halves to boost only. Full rank keeps its two
    norm weights whole (d each, or with sequence parallelism too), boost its γ sharded (d/t),
    naive replicated."""
    mode = check_mode(mode)
    gemms = _factor_gemms(shape, mode, t)
    norms = local_numel(mode, Tensor.NORM_WEIGHT, 2 * shape.hidden, t)
    sp = sequence_parallel and mode is TPMode.FULL
    # the heads are split where qkv is split along its output (not naive: replicated)
    heads = shape.heads / t if Dim.D_OUT in split_dims(mode, Group.QKV) else shape.heads
    spec = LedgerSpec(shape=shape, layout=ParallelLayout(mode=mode, tp=t, sequence_parallel=sp),
                      micro_batch=micro_batch, seq_length=shape.seq_length, dtype="bf16",
                      overlap_chunks=overlap_chunks if mode is TPMode.BOOST else 1,
                      interleave_halves=interleave_halves and mode is TPMode.BOOST)
    return LayerWork(gemms=gemms, attn_heads=heads,
                     collectives=tp_collectives(shape, mode, dtype="bf16",
                                                sequence_parallel=sp),
                     params=_local_params(gemms) + norms, ledger_spec=spec)


# ---------------------------------------------------------------------------------------------
# prediction
# ---------------------------------------------------------------------------------------------


@dataclass
class Prediction:
    model: str
    gpu: str
    mode: str
    layout: Dict
    iteration_s: float
    breakdown_s: Dict[str, float]
    memory_gb: Dict[str, float]
    comm: Dict[str, float]
    fits: bool
    tokens_per_s_per_gpu: float
    mfu: float

    def to_dict(self) -> Dict:
        return dataclasses.asdict(self)


def pipeline_time(stage_times: Sequence[float], m: int, v: int = 1) -> Tuple[float, float]:
    """1F1B schedule of ``m`` micro-batches over stages taking ``stage_times`` (forward +
    backward of one micro-batch each), ``v`` virtual stages per rank: (total, bubble).

    ``total = m · max + (Σ − max) / v``: the busiest stage works ``m`` micro-batches, and the
    fill/drain of the other stages is exposed once (divided by v with interleaving). For ``p``
    equal stages of time ``t`` this is ``(m + (p−1)/v) · t``: bubble fraction
    ``(p−1)/(m+p−1)`` for v = 1.
    """
    t_max = max(stage_times)
    total = m * t_max + (sum(stage_times) - t_max) / max(1, v)
    return total, total - m * t_max


def _stage_layers(L: int, p: int) -> List[int]:
    base, extra = divmod(L, p)
    return [base + (1 if i < extra else 0) for i in range(p)]


def _validate(shape: ModelShape, layout: Layout) -> None:
    mode, t, p = layout.mode, layout.tp, layout.pp  # the record parsed the mode
    rc = layout.recompute or "none"
    if rc not in RECOMPUTE:
        raise ValueError(f"unknown recompute '{rc}'; one of {RECOMPUTE}")
    if rc == "lowrank" and not mode.is_lowrank:
        raise ValueError("recompute 'lowrank' needs a bottleneck model (mode naive or boost)")
    resolve_sequence_parallel(mode, t, layout.sequence_parallel)  # refuses SP outside full
    if p > shape.num_layers:
        raise ValueError(f"pp ({p}) exceeds the number of layers ({shape.num_layers})")
    # The trainer's own rule (boost never shards the rank, so r % t is not required there).
    check_tp_split(mode, t, hidden_size=shape.hidden, ffn_hidden_size=shape.ffn,
                   num_attention_heads=shape.heads, num_query_groups=shape.g,
                   attn_rank=shape.r_attn, mlp_rank=shape.r_mlp)


@dataclass(frozen=True)
class _Setting:
    """What every phase of :func:`predict` needs: the shape, the layout, the hardware, the
    layer work, and the tokens / links of one micro-batch."""

    shape: ModelShape
    layout: Layout
    hw: HardwareSpec
    work: LayerWork
    n: int            # tokens of one micro-batch (b · s)
    m: int            # micro-batches per step
    d_loc: float      # residual stream per token on one GPU (d/t in boost and with SP)
    sp: bool          # megatron's sequence parallelism (full mode)
    tp_intra: bool
    dp_intra: bool
    pp_intra: bool    # all stages of a pipeline inside one node

    @classmethod
    def of(cls, shape: ModelShape, layout: Layout, hw: HardwareSpec) -> "_Setting":
        t, dp, p = layout.tp, layout.dp, layout.pp
        gpn = layout.gpus_per_node or hw.gpus_per_node
        d, sp = shape.hidden, layout.resolved_sequence_parallel
        return cls(shape=shape, layout=layout, hw=hw,
                   work=layer_work(shape, layout.mode, t, sp, layout.micro_batch,
                                   layout.overlap_chunks, layout.interleave_halves),
                   n=layout.micro_batch * shape.seq_length, m=layout.num_micro_batches,
                   d_loc=local_numel(layout.mode, Tensor.STREAM, d, t, sequence_parallel=sp),
                   sp=sp,
                   tp_intra=t <= gpn,
                   dp_intra=t * dp <= gpn, pp_intra=t * dp * p <= gpn)

    def tp_allreduce(self, nbytes: float) -> float:
        return allreduce_time(nbytes, self.layout.tp, self.hw, self.tp_intra)

    def tp_allgather(self, nbytes: float) -> float:
        return allgather_time(nbytes, self.layout.tp, self.hw, self.tp_intra)


def _gemm_fwd_bwd(gemms: Iterable[Gemm], n: int, hw: HardwareSpec) -> Tuple[float, float]:
    """Forward and backward seconds of token-major GEMMs (M = n tokens); each forward GEMM has
    a data-gradient (M, K, N) and a weight-gradient (K, N, M) GEMM in backward."""
    fw = bw = 0.0
    for gm in gemms:
        fw += gemm_time(n, gm.N, gm.K, hw)
        bw += gemm_time(n, gm.K, gm.N, hw) + gemm_time(gm.K, gm.N, n, hw)
    return fw, bw


def _recompute_cost(st: _Setting, g_fwd: float, gB_fwd: float, a_fwd: float, el_fwd: float,
                    c_fwd: float) -> Tuple[float, float]:
    """(compute, communication) seconds the recompute policy re-runs in backward, besides what
    the op ledger's backward already holds (low-rank recompute: its element-wise kernels)."""
    rc = st.layout.recompute or "none"
    if rc == "none":
        return 0.0, 0.0
    if rc == "selective":
        return a_fwd, 0.0
    if rc == "full":
        return g_fwd + a_fwd + el_fwd, c_fwd
    # lowrank: the B GEMMs and the attention core (docs/design.md §7); naive's B outputs come
    # out of an all-reduce, so they are kept, not recomputed
    return (a_fwd if TPMode.parse(st.layout.mode) is TPMode.NAIVE else gB_fwd + a_fwd), 0.0


def _exposed_tp_seconds(st: _Setting, ledger) -> Tuple[float, float]:
    """(forward, backward) seconds the layer's TP collectives keep it waiting: the op ledger's
    stream on one compute and one communication stream (``perf/layer_time.py``, the same
    schedule ``tools/layer_ops.py`` prints), priced at this GPU with the model's curves."""
    from megatron_boost.perf.layer_time import KernelCosts, layer_time

    costs = KernelCosts(st.hw, st.layout.tp, flop_eff=None, intra_node=st.tp_intra)
    timed = layer_time(ledger, costs)
    return timed.exposed["fwd"], timed.exposed["bwd"]


def _memory_bound_seconds(ledger, phase: str, hw: HardwareSpec) -> float:
    """The op ledger's element-wise, fused and copy kernels of ``phase``: their bytes at the
    achieved HBM bandwidth, and a launch gap each."""
    from megatron_boost.measure.ledger import TRAFFIC_KINDS

    kernels = sum(ledger.count(phase, kind) for kind in TRAFFIC_KINDS)
    return elementwise_time(ledger.traffic(phase), hw, kernels=kernels)


def _layer_times(st: _Setting) -> Tuple[Dict[str, float], Dict[str, float]]:
    """Compute and TP-communication phases of one layer, one micro-batch: (fwd, bwd) seconds
    per category; recompute is charged to backward. GEMMs and the attention core from the
    shapes; element-wise traffic, kernel launches and TP collectives (with what hides them)
    from the op ledger."""
    w, n, hw, b = st.work, st.n, st.hw, st.layout.micro_batch
    rc = st.layout.recompute or "none"
    ledger = w.ledger("lowrank" if rc == "lowrank" else None)
    g_fwd, g_bwd = _gemm_fwd_bwd(w.gemms, n, hw)
    gB_fwd, _ = _gemm_fwd_bwd([gm for gm in w.gemms if gm.kind != "A"], n, hw)
    a_fwd, a_bwd = attention_time(b, st.shape.seq_length, int(w.attn_heads), st.shape.e, hw)
    el_fwd, el_bwd = (_memory_bound_seconds(ledger, phase, hw) for phase in ("fwd", "bwd"))
    c_fwd, c_bwd = _exposed_tp_seconds(st, ledger) if st.layout.tp > 1 else (0.0, 0.0)
    rec, rec_comm = _recompute_cost(st, g_fwd, gB_fwd, a_fwd, el_fwd, c_fwd)
    layer_f = {"gemm": g_fwd, "attention": a_fwd, "elementwise": el_fwd, "tp_comm": c_fwd}
    layer_b = {"gemm": g_bwd, "attention": a_bwd, "elementwise": el_bwd,
               "tp_comm": c_bwd + rec_comm, "recompute": rec}
    return layer_f, layer_b


def _embedding_times(st: _Setting) -> Dict[str, float]:
    """Embedding (first stage), forward + backward of one micro-batch, per category."""
    n, hw = st.n, st.hw
    out = {"elementwise": elementwise_time(n * st.d_loc * BYTES_ACT, hw)
           + elementwise_time(n * st.d_loc * (BYTES_ACT + BYTES_GRAD * 2), hw)}
    # full, naive: vocab-parallel all-reduce of d forward (with SP a reduce-scatter, all-gather
    # backward); tied boost: reduce-scatter of d
    # forward, all-gather backward (analysis/comm.py's embedding_collectives)
    collectives = embedding_collectives(st.shape, st.layout.mode, st.sp)
    if collectives:
        out["tp_comm"] = _collectives_seconds(st, collectives)
    return out


def _collectives_seconds(st: _Setting, collectives) -> float:
    """Seconds of one micro-batch's (direction, kind, width per token) TP collectives of the
    activations (``analysis/comm.py``)."""
    time_of = {"all_reduce": st.tp_allreduce, "all_gather": st.tp_allgather,
               "reduce_scatter": st.tp_allgather}  # ring: same cost both ways
    return sum(time_of[kind](st.n * width * BYTES_ACT) for _, kind, width in collectives)


def _head_times(st: _Setting) -> Dict[str, float]:
    """LM head and vocab-parallel cross entropy (last stage), forward + backward of one
    micro-batch, per category."""
    n, hw, d, t, V = st.n, st.hw, st.shape.hidden, st.layout.tp, st.shape.vocab
    def vocab_share(size):  # the head's [V, d] is split along V (the table's HEAD entry)
        return local_numel(st.layout.mode, Tensor.HEAD, size, t)

    hf, hb = _gemm_fwd_bwd([Gemm("lm_head", vocab_share(V), d, "head")], n, hw)
    el_f = elementwise_time(n * (4 * d + vocab_share(CE_BYTES_FWD * V)), hw, 6)
    el_b = elementwise_time(n * (6 * d + vocab_share(CE_BYTES_BWD * V)), hw, 3)
    # max, sum-exp and target-logit all-reduces (fp32), then boost's all-gather of the hidden
    # shards forward and the output layer's all-reduce of d backward; with SP its input's
    # all-gather forward, reduce-scatter and re-gather backward (head_collectives)
    comm = CROSS_ENTROPY_FP32_VALUES * st.tp_allreduce(n * 4)
    comm += _collectives_seconds(st, head_collectives(st.shape, st.layout.mode, st.sp))
    return {"gemm": hf + hb, "elementwise": el_f + el_b, "tp_comm": comm}


_COMPUTE_KEYS = ("gemm", "attention", "elementwise", "tp_comm", "recompute")


def _stage_times(st: _Setting, layers: List[int]) -> List[Dict[str, float]]:
    """Pipeline phase: per stage, seconds of one micro-batch forward + backward per category
    (embedding on the first stage, head on the last) and their total."""
    layer_f, layer_b = _layer_times(st)
    emb, head = _embedding_times(st), _head_times(st)
    p = len(layers)
    stages = []
    for i, nl in enumerate(layers):
        s = {k: nl * (layer_f.get(k, 0.0) + layer_b.get(k, 0.0)) for k in _COMPUTE_KEYS}
        for k in _COMPUTE_KEYS:
            s[k] += (emb.get(k, 0.0) if i == 0 else 0.0)
            s[k] += (head.get(k, 0.0) if i == p - 1 else 0.0)
        s["total"] = sum(s[k] for k in _COMPUTE_KEYS)
        stages.append(s)
    return stages


def _p2p_seconds(st: _Setting) -> float:
    """Pipeline p2p: one activation (forward) and one gradient (backward) per micro-batch per
    boundary; the boundary messages of the first/last micro-batch and each steady-state
    exchange sit on the critical path."""
    p, v = st.layout.pp, max(1, st.layout.vpp or 1)
    if p <= 1:
        return 0.0
    return 2 * (st.m * v + p - 2) * p2p_time(st.n * st.d_loc * BYTES_ACT, st.hw, st.pp_intra)


def _stage_params(st: _Setting, layers: List[int]) -> List[float]:
    """Parameters per GPU of each stage: layers, embedding (first), head and final norm
    (last; the tied head needs its own copy only when it sits on another stage)."""
    shape, t, p = st.shape, st.layout.tp, len(layers)
    mode, table = st.layout.mode, shape.vocab * shape.hidden
    emb_local = local_numel(mode, Tensor.EMBEDDING, table, t, tied=shape.tied_embeddings)
    head_local = emb_local if shape.tied_embeddings else local_numel(mode, Tensor.HEAD, table, t)
    out = []
    for i, nl in enumerate(layers):
        sp = nl * st.work.params
        if i == 0:
            sp += emb_local
        if i == p - 1:
            if not shape.tied_embeddings or p > 1:
                sp += head_local  # untied head, or the tied copy on the last stage
            sp += local_numel(mode, Tensor.FINAL_NORM_WEIGHT, shape.hidden, t)  # final norm
        out.append(sp)
    return out


def _dp_seconds(st: _Setting, params_gpu: float, busiest_total: float) -> float:
    """Exposed DP gradient reduction: reduce-scatter + all-gather (distributed optimizer) or
    all-reduce of the fp32 gradients, partly hidden behind the last micro-batch's backward."""
    lay, hw = st.layout, st.hw
    if lay.dp <= 1:
        return 0.0
    if lay.distributed_optimizer:  # reduce-scatter fp32 grads + all-gather bf16 params
        t_full = (allgather_time(params_gpu * BYTES_GRAD, lay.dp, hw, st.dp_intra)
                  + allgather_time(params_gpu * BYTES_WEIGHT, lay.dp, hw, st.dp_intra))
    else:
        t_full = allreduce_time(params_gpu * BYTES_GRAD, lay.dp, hw, st.dp_intra)
    if not lay.overlap_grad_reduce:
        return t_full
    last_bwd = busiest_total * BACKWARD_SHARE_OF_STEP
    return max(t_full * (1 - hw.dp_overlap), t_full - last_bwd)


def _step_tail(st: _Setting, params_gpu: float, busiest_total: float) -> Dict[str, float]:
    """Communication and optimizer phase after the pipeline: exposed DP reduction, tied
    embedding-gradient all-reduce between first and last stage, optimizer, host overhead."""
    shape, lay, hw = st.shape, st.layout, st.hw
    t_tied = 0.0
    if shape.tied_embeddings and lay.pp > 1:
        emb_local = local_numel(lay.mode, Tensor.EMBEDDING, shape.vocab * shape.hidden, lay.tp,
                                tied=True)
        t_tied = allreduce_time(emb_local * BYTES_GRAD, 2, hw, st.pp_intra)
    opt_params = params_gpu / (lay.dp if lay.distributed_optimizer else 1)
    return {"dp": _dp_seconds(st, params_gpu, busiest_total), "tied": t_tied,
            "optimizer": elementwise_time(opt_params * OPTIMIZER_BYTES_PER_PARAM, hw,
                                          kernels=10),
            "host": hw.step_overhead_ms * 1e-3}


def _saved_per_layer(st: _Setting, recompute: str) -> float:
    """Bytes one layer keeps for its backward, one micro-batch, from the op ledger: all of it
    without recompute; without the attention core's under selective recompute; the
    checkpointed layer's under low-rank recompute; the layer input under full recompute."""
    ledger = st.work.ledger()
    if recompute == "none":
        return ledger.saved_bytes
    if recompute == "selective":
        return ledger.saved_bytes - ledger.saved_by_scope.get(CORE_ATTENTION_SCOPE, 0)
    if recompute == "lowrank":
        return st.work.ledger("lowrank").saved_bytes
    return st.n * st.d_loc * BYTES_ACT  # full: the layer's input


def _stage_memory(st: _Setting, i: int, nl: int, sp: float) -> Dict[str, float]:
    """GB on one GPU of stage ``i``. 1F1B: stage i keeps the activations of min(m, p - i)
    micro-batches in flight; interleaving (v > 1) adds (p - 1)/(p·v) of that (Megatron's
    estimate)."""
    n, lay = st.n, st.layout
    p, v, rc = lay.pp, max(1, lay.vpp or 1), lay.recompute or "none"
    inflight = float(min(st.m, p - i))
    if v > 1 and p > 1:
        inflight *= 1 + (p - 1) / (p * v)
    act = _saved_per_layer(st, rc) * nl * inflight
    if rc in ("full", "lowrank"):  # the working set of the one layer being recomputed
        act += st.work.ledger().saved_bytes
    if i == 0:  # embedding output
        act += n * st.d_loc * BYTES_ACT * inflight
    if i == p - 1:  # bf16 logits + fp32 softmax of the vocab-parallel cross entropy
        act += n * local_numel(lay.mode, Tensor.HEAD, st.shape.vocab, lay.tp) * (BYTES_ACT + 4)
    opt_div = lay.dp if lay.distributed_optimizer else 1
    mem = {"weights": sp * BYTES_WEIGHT / 1e9, "grads": sp * BYTES_GRAD / 1e9,
           "optimizer": sp * BYTES_OPTIM / opt_div / 1e9, "activations": act / 1e9,
           "reserved": st.hw.reserved_memory_gb}
    mem["total"] = sum(mem.values())
    return mem


def _memory(st: _Setting, layers: List[int], stage_params: List[float]) -> Dict[str, float]:
    """Memory phase: the fullest stage's GB per GPU, rounded."""
    per_stage = [_stage_memory(st, i, nl, sp)
                 for i, (nl, sp) in enumerate(zip(layers, stage_params))]
    mem = max(per_stage, key=lambda x: x["total"])
    return {k: round(x, 3) for k, x in mem.items()}


def _comm_volumes(st: _Setting, nl_max: int, grad_bytes: float) -> Dict:
    """TP elements and bytes per layer, TP bytes per iteration, DP and PP bytes."""
    w, n, t = st.work, st.n, st.layout.tp
    fwd, bwd = sum(w.coll_fwd), sum(w.coll_bwd)
    tp = t > 1
    return {
        "tp_elements_per_token_per_layer_fwd": fwd if tp else 0,
        "tp_elements_per_token_per_layer_bwd": bwd if tp else 0,
        "tp_collectives_per_layer": (len(w.coll_fwd) + len(w.coll_bwd)) if tp else 0,
        "tp_bytes_per_layer_fwd": (n * fwd * BYTES_ACT) if tp else 0,
        "tp_bytes_per_layer_bwd": (n * bwd * BYTES_ACT) if tp else 0,
        "tp_bytes_per_iteration": (st.m * nl_max * n * (fwd + bwd) * BYTES_ACT) if tp else 0,
        "dp_gradient_bytes": grad_bytes if st.layout.dp > 1 else 0,
        "pp_p2p_bytes_per_microbatch": (n * st.d_loc * BYTES_ACT) if st.layout.pp > 1 else 0,
        "tp_link": "nvlink" if st.tp_intra else "network",
    }


def _model_flops(st: _Setting, tokens: int) -> float:
    """Model FLOPs of one iteration: the trainer's count (``analysis/flops.py``: matmuls,
    causal attention core, forward + backward = 3 × forward), so both MFUs compare."""
    return step_flops(st.shape, st.layout.mode, tokens, st.shape.vocab, st.shape.seq_length)


def predict(shape: ModelShape, layout: Layout, hw: HardwareSpec) -> Prediction:
    """Iteration time, memory and communication of one layout (one GPU of the busiest stage):
    compute and TP communication per stage, the pipeline schedule and p2p, the DP reduction
    and optimizer, memory, communication volumes and MFU."""
    _validate(shape, layout)
    st = _Setting.of(shape, layout, hw)
    layers = _stage_layers(shape.num_layers, layout.pp)
    stages = _stage_times(st, layers)
    busiest = max(range(layout.pp), key=lambda i: stages[i]["total"])
    t_pipe, bubble = pipeline_time([s["total"] for s in stages], st.m,
                                   max(1, layout.vpp or 1))
    t_p2p = _p2p_seconds(st)
    stage_params = _stage_params(st, layers)
    params_gpu = max(stage_params)
    tail = _step_tail(st, params_gpu, stages[busiest]["total"])
    total = t_pipe + t_p2p + tail["dp"] + tail["tied"] + tail["optimizer"] + tail["host"]
    bs, m = stages[busiest], st.m
    breakdown = {
        "gemm": m * bs["gemm"], "attention": m * bs["attention"],
        "elementwise": m * bs["elementwise"], "tp_comm": m * bs["tp_comm"],
        "recompute": m * bs["recompute"], "pp_bubble": bubble, "pp_p2p": t_p2p,
        "dp_comm_exposed": tail["dp"] + tail["tied"], "optimizer": tail["optimizer"],
        "step_overhead": tail["host"],
    }
    mem = _memory(st, layers, stage_params)
    tokens = m * layout.micro_batch * layout.dp * shape.seq_length
    mfu = _model_flops(st, tokens) / (total * layout.gpus * hw.peak_bf16_tflops * 1e12)
    layout_d = layout.to_dict()
    layout_d["num_micro_batches"] = m
    layout_d["gpus_per_node"] = layout.gpus_per_node or hw.gpus_per_node
    return Prediction(
        model=shape.name, gpu=hw.name, mode=layout.mode, layout=layout_d,
        iteration_s=round(total, 6), breakdown_s={k: round(x, 6) for k, x in breakdown.items()},
        memory_gb=mem, comm=_comm_volumes(st, max(layers), params_gpu * BYTES_GRAD),
        fits=mem["total"] <= hw.memory_gb,
        tokens_per_s_per_gpu=round(tokens / total / layout.gpus, 2), mfu=round(mfu, 4))
