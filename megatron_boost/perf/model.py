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

The three TP modes follow ``/work/shared/DESIGN.md`` §2:

``full``   full-rank model, Megatron TP: column-parallel qkv/fc1, row-parallel proj/fc2; the
           residual stream, both RMSNorms and the residual adds are replicated on every TP rank;
           per layer 2 all-reduces of d forward and 2 backward.
``naive``  bottleneck model, every (A, B) pair is one Megatron chunk: A column-parallel (local
           rank r/t), σ on the local slice, B row-parallel + all-reduce of the full output. The
           attention core, RoPE, SwiGLU, norms and residual adds run on full tensors, replicated
           on every TP rank (NOT divided by t). Forward all-reduces (q+2kv) + d + 2f + d
           (= 5d + 2f for MHA), backward d + (h·e) + d + f (= 3d + f for MHA); 8 collectives.
``boost``  bottleneck model with the residual stream sharded along d: A row-sharded (K = in/t),
           all-reduce of the r-wide partial product (+1 rms partial sum for the normed groups),
           σ, B column-sharded (N = out/t). Everything is divided by t except the r-wide
           bottleneck activations. Forward 7r + 2, backward 7r; 8 collectives.

Model of one kernel (all times in seconds; P = bf16 peak × sustained_clock_ratio):

* GEMM ``(M, N, K)`` (``2·M·N·K`` FLOPs, bf16):
  ``t = max(2MNK / (P · η(M,N,K)),  2(MK + KN + MN) / (B_hbm · η_mem)) + t_launch``, with the
  shape efficiency a saturating function of the arithmetic intensity
  ``I = MNK / (MN + NK + MK)`` (FLOP/byte): ``η = η_max · I / (I + I_half)``. For training
  GEMMs (M = b·s large) ``I ≈ N·K/(N + K)``: the rank slice r/t of naive TP (N or K = r/t) sits
  low on the curve, the boost shapes (K = d/t, N = r; N = d/t, K = r) higher, full-rank shapes
  near η_max. Every forward GEMM has two backward GEMMs (data gradient ``(M, K, N)``, weight
  gradient ``(K, N, M)``).
* Attention core (flash attention, causal): forward FLOPs ``4·b·s²·e·heads / 2``, backward
  2.5× forward; efficiency ``η_attn = η_attn_max · e/(e + e_half) · s/(s + s_half)`` forward
  and ``attn_bwd_ratio · η_attn`` backward.
* Element-wise kernels (RMSNorm, RoPE, SwiGLU, σ, residual adds, cross entropy): bytes moved /
  (B_hbm · η_mem) + t_launch.
* Collectives, alpha-beta with ring algorithms over ``n`` ranks: all-reduce
  ``2(n-1)·α + 2(n-1)/n · bytes / (B_link · η_link)``; all-gather / reduce-scatter: half;
  p2p ``α + bytes/(B_link · η_link)``. A group that fits in one node uses NVLink (on a
  switchless full mesh such as Perlmutter's 4-GPU node, only the links to the group's n-1
  peers: min(B_nvlink, (n-1)·B_pair)), otherwise InfiniBand (per-GPU NIC bandwidth).
* Pipeline (1F1B, ``m`` micro-batches, ``p`` stages, ``v`` virtual stages):
  ``T_pipe = m · max_stage + (Σ_stages − max_stage) / v`` — for equal stages this is
  ``(m + (p−1)/v) · t_stage``, i.e. a bubble fraction ``(p−1)/(m+p−1)`` for ``v = 1``.
* Recompute: ``full`` keeps only each layer's input and re-runs the whole layer forward
  (collectives included) in backward; ``selective`` drops the attention output and re-runs the
  attention core; ``lowrank`` (bottleneck modes, DESIGN.md) keeps the layer input and the
  all-reduced r-wide bottleneck activations (+ rms scalars) and re-runs everything except the A
  products and the collectives (σ, B products, attention core, SwiGLU, RoPE, norms). In naive
  mode the B outputs come out of an all-reduce, so ``lowrank`` keeps them too and recomputes only
  σ, norms, RoPE, the attention core and SwiGLU.
* Memory per GPU (fullest pipeline stage): bf16 weights (2 B/param), fp32 gradients (4), Adam
  fp32 master + m + v (12, divided by dp with the distributed optimizer), activations saved for
  backward under the recompute policy × micro-batches in flight (1F1B: min(m, p − stage)),
  bf16 logits + fp32 softmax on the last stage, and a reserved amount (CUDA context, NCCL).
* DP: gradient all-reduce (fp32) of the stage's parameters, overlapped with the backward of the
  last micro-batch by a fraction ``dp_overlap`` when ``overlap_grad_reduce`` is on.
* Optimizer: fused Adam is HBM-bound: ``OPTIMIZER_BYTES_PER_PARAM`` bytes per local parameter.

``mfu`` counts model FLOPs: 6 per parameter per token (layers + LM head) plus the causal
attention core (half the s×s square) forward and backward; naive's duplicated work is not
counted.

Every hardware number and every calibrated efficiency lives in :data:`HARDWARE` (one
:class:`HardwareSpec` per GPU type; each entry says where its number comes from).

The published comparison (:func:`compare_published`) reproduces the BOOST authors' A100 table
(README of github.com/Arcana-2236/BOOST, also Fig. 5 of arXiv 2512.12131). Setup taken from the
authors' released configs (``examples/*.yaml``, ``.logging/iter_comp_mbz4/configs``) and the
paper's §5: NERSC Perlmutter, 4 A100 per node on NVLink3, Slingshot-11 between nodes
(4 × 25 GB/s NICs per node, i.e. 25 GB/s per GPU), nanotron with flash-attn 2, bf16,
micro-batch 4, sequence 4096, dp = 1, ``batch_accumulation_per_replica = 1`` (one micro-batch per
step, so the 13B TP4×PP2 run has a 1F1B bubble of 1/2), ``tie_word_embeddings: true``,
``recompute_layer: false``. Weak scaling: GPUs = TP × PP.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = [
    "HardwareSpec", "HARDWARE", "ModelShape", "Layout", "Prediction", "PUBLISHED_SHAPES",
    "PUBLISHED_A100", "gemm_efficiency", "gemm_time", "attention_efficiency",
    "tp_comm_elements_per_token", "layer_work", "pipeline_time", "predict", "hardware",
    "compare_published", "format_published", "recommend", "format_recommend",
    "format_prediction", "main",
]

MODES = ("full", "naive", "boost")
RECOMPUTE = ("none", "selective", "full", "lowrank")

# ---------------------------------------------------------------------------------------------
# The hardware table: every hardware number and every efficiency/calibration parameter.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HardwareSpec:
    """One GPU type in one kind of node. Units: TFLOP/s, GB/s (1e9 B/s), GB (1e9 B), µs."""

    name: str
    peak_bf16_tflops: float
    """Dense bf16 tensor-core peak (no sparsity), at the boost clock."""
    sustained_clock_ratio: float
    """Fraction of the boost-clock peak sustained during long training runs (power/thermal
    capping, and whatever else separates kernel microbenchmarks from a training loop). Scales
    every tensor-core kernel (GEMM, attention); memory-bound kernels are not affected."""
    hbm_gb_s: float
    """HBM bandwidth."""
    memory_gb: float
    """HBM capacity."""
    nvlink_gb_s: float
    """NVLink bandwidth per GPU per direction (the ring 'bus bandwidth' ceiling)."""
    nvlink_peer_gb_s: Optional[float]
    """Switchless full-mesh nodes only: NVLink bandwidth per GPU pair per direction; a group of
    n GPUs then reaches min(nvlink_gb_s, (n-1)·nvlink_peer_gb_s). None: NVSwitch (every group
    size gets nvlink_gb_s)."""
    ib_gb_s: float
    """Inter-node network bandwidth per GPU per direction (one NIC per GPU)."""
    gpus_per_node: int
    """GPUs sharing one NVLink domain (default; the CLI can override)."""
    nvlink_latency_us: float
    """α per ring step of an NVLink collective (NCCL launch + protocol)."""
    ib_latency_us: float
    """α per ring step / p2p message over the inter-node network."""
    gemm_eff_max: float
    """η_max of the GEMM shape-efficiency curve (large, square-ish bf16 GEMMs)."""
    gemm_intensity_half: float
    """I_half: the arithmetic intensity (FLOP/byte) at which η = η_max / 2."""
    attn_eff_max: float
    """η_attn_max of the flash-attention efficiency curve (forward)."""
    attn_head_dim_half: float
    """e_half: head dimension at which the attention efficiency halves."""
    attn_seq_half: float
    """s_half: sequence length at which the attention efficiency halves."""
    attn_bwd_ratio: float
    """Backward attention efficiency relative to forward."""
    mem_eff: float
    """Fraction of the HBM bandwidth reached by element-wise kernels."""
    nvlink_eff: float
    """Fraction of the NVLink bandwidth reached by NCCL ring collectives (bus bandwidth)."""
    ib_eff: float
    """Fraction of the NIC bandwidth reached by NCCL over the network."""
    kernel_launch_us: float
    """Gap per kernel (launch latency / inter-kernel idle) added to every kernel."""
    dp_overlap: float
    """Fraction of the DP gradient reduction hidden behind backward when overlap is on."""
    reserved_memory_gb: float
    """CUDA context, NCCL buffers, allocator fragmentation: memory not usable by tensors."""
    step_overhead_ms: float = 0.0
    """Fixed host-side cost per optimizer step (data loader, loss/grad-norm sync, logging)."""


# The ONE parameter fitted to the end-to-end published table: least squares of log(pred/pub)
# over all 12 cells of compare_published (optimum 0.80; 0.78-0.84 all keep 12/12 cells within
# ±15 %), every other A100 parameter held at its datasheet / microbenchmark value. The per-op
# sources (the authors' forward-only GEMM benchmark, the FA2 paper) time short kernels at boost
# clock; a training iteration sustains ~0.8 of that on A100 SXM4: 400 W power capping (sustained
# tensor-core clocks well below the 1410 MHz boost), backward weight-gradient GEMMs of small
# low-rank factors (few output tiles) that the forward benchmark never timed, allocator and
# stream-synchronisation stalls.
SUSTAINED_A100 = 0.80

_A100_COMMON = dict(
    peak_bf16_tflops=312.0,    # NVIDIA A100 datasheet: 312 TFLOP/s dense BF16 (SXM4, 1410 MHz)
    sustained_clock_ratio=SUSTAINED_A100,  # calibrated, see SUSTAINED_A100 above
    nvlink_gb_s=300.0,         # NVLink3, 12 links x 25 GB/s: 600 GB/s bidirectional per GPU,
                               # 300 GB/s per direction
    nvlink_peer_gb_s=None,     # HGX/DGX A100: NVSwitch, every group gets the full 300 GB/s
    ib_gb_s=25.0,              # one HDR 200 Gb/s InfiniBand NIC per GPU (DGX A100)
    gpus_per_node=8,           # HGX/DGX A100 8-GPU baseboard
    nvlink_latency_us=5.0,     # calibrated: BOOST authors' per-layer TP all-reduce timings
                               # (Arcana-2236/BOOST .logging/communication_efficiency, 7B TP4):
                               # fixed cost ~0.26 ms per 8 all-reduces of 4 ranks -> ~5 µs per
                               # ring step
    ib_latency_us=10.0,        # assumption: NCCL small-message latency over IB / Slingshot
    gemm_eff_max=0.88,         # calibrated: least-squares fit of η_max·I/(I+I_half) (+4 µs per
                               # GEMM) to the BOOST authors' A100 GEMM benchmark
                               # (.logging/computation_efficiency: full-rank, vanilla-TP and BTP
                               # attention/MLP GEMMs of 3B/7B/13B at TP4, 4096 tokens; fit
                               # residuals within ±10 % except vanilla-3B attention +17 %); η_max
                               # bounded to <= 0.9 (cuBLAS on A100 tops out at ~280 TFLOP/s)
    gemm_intensity_half=120.0, # same fit; close to the A100-80GB ridge point 312/2.04 = 153
                               # FLOP/byte
    attn_eff_max=0.71,         # calibrated on the FlashAttention-2 paper (Dao 2023, A100 SXM4,
                               # causal): forward ~0.62 of peak at e=128, ~0.55 at e=64 (s=4k)
    attn_head_dim_half=19.0,   # same fit (e=64 vs e=128)
    attn_seq_half=128.0,       # assumption: FA2 tiles are 128 tokens; short sequences waste them
    attn_bwd_ratio=0.8,        # FA2 paper: backward reaches ~80 % of the forward throughput
    mem_eff=0.80,              # assumption: element-wise kernels reach ~80 % of the HBM peak
    nvlink_eff=0.72,           # calibrated: authors' comm benchmark, 1328 MiB all-reduced over
                               # TP4 in 9.75 ms -> bus bandwidth ~215 GB/s of 300 (nccl-tests on
                               # DGX A100 report ~230 GB/s, 0.77)
    ib_eff=0.80,               # assumption: NCCL reaches ~80 % of the NIC line rate
    kernel_launch_us=4.0,      # assumption: eager-PyTorch launch gap, 3-5 µs per kernel (also the
                               # per-GEMM overhead of the GEMM fit above)
    dp_overlap=0.8,            # assumption: Megatron overlap_grad_reduce hides ~80 % of the DP
                               # reduction behind backward
    reserved_memory_gb=3.0,    # assumption: CUDA context ~0.5 GB, NCCL buffers, allocator slack
)

_H100_COMMON = dict(
    peak_bf16_tflops=989.0,    # NVIDIA H100/H200 SXM datasheet: 989 TFLOP/s dense BF16
    sustained_clock_ratio=0.90,  # assumption (NOT calibrated): the A100 microbenchmark-to-
                                 # training factor is 0.80; η_max below is already a sustained
                                 # figure, so only part of that factor is applied
    nvlink_gb_s=450.0,         # NVLink4, 18 links: 900 GB/s bidirectional -> 450 per direction
    nvlink_peer_gb_s=None,     # HGX H100/H200: NVSwitch
    ib_gb_s=50.0,              # one NDR 400 Gb/s NIC per GPU (DGX H100 / HGX H200 reference)
    gpus_per_node=8,           # HGX 8-GPU baseboard
    nvlink_latency_us=5.0,     # assumption: as A100 (NCCL ring step)
    ib_latency_us=8.0,         # assumption: NDR
    gemm_eff_max=0.75,         # assumption (NOT calibrated here): cuBLAS bf16 large GEMMs reach
                               # ~700-750 TFLOP/s on H100 SXM
    gemm_intensity_half=230.0, # assumption (NOT calibrated): A100 fit scaled by the ridge-point
                               # ratio (989/3.35 = 295 vs 153 FLOP/byte)
    attn_eff_max=0.60,         # assumption: FlashAttention-3 / cuDNN fused attention, ~500-600
                               # TFLOP/s causal bf16 at e=128 (FA3 paper, Shah et al. 2024)
    attn_head_dim_half=19.0,   # as the A100 fit
    attn_seq_half=256.0,       # assumption: larger tiles than FA2
    attn_bwd_ratio=0.75,       # assumption: FA3 backward below forward throughput
    mem_eff=0.80,              # assumption
    nvlink_eff=0.80,           # nccl-tests all_reduce bus bandwidth ~360 GB/s of 450 (DGX H100)
    ib_eff=0.80,               # assumption
    kernel_launch_us=4.0,      # assumption
    dp_overlap=0.8,            # assumption
    reserved_memory_gb=3.0,    # assumption
)

HARDWARE: Dict[str, HardwareSpec] = {
    "a100-80gb": HardwareSpec(
        name="a100-80gb", **_A100_COMMON,
        hbm_gb_s=2039.0,       # A100 80GB SXM4 datasheet: 2,039 GB/s HBM2e
        memory_gb=80.0,        # datasheet
    ),
    "a100-40gb": HardwareSpec(
        name="a100-40gb", **_A100_COMMON,
        hbm_gb_s=1555.0,       # A100 40GB SXM4 datasheet: 1,555 GB/s HBM2
        memory_gb=40.0,        # datasheet
    ),
    # The node of the BOOST authors' published table: NERSC Perlmutter GPU node (NERSC
    # architecture docs): 4 A100 SXM4 wired all-to-all with NVLink3, 4 links (100 GB/s per
    # direction) per GPU pair, no NVSwitch; 4 Slingshot-11 NICs (200 Gb/s each) per node, i.e.
    # 25 GB/s per GPU; the paper's runs use the 80 GB nodes.
    "a100-80gb-perlmutter": HardwareSpec(
        name="a100-80gb-perlmutter", **{**_A100_COMMON, **dict(
            gpus_per_node=4,           # Perlmutter GPU node
            nvlink_peer_gb_s=100.0,    # 4 NVLink3 links x 25 GB/s per direction per GPU pair
        )},
        hbm_gb_s=2039.0,       # A100 80GB SXM4 datasheet
        memory_gb=80.0,        # datasheet
    ),
    "h100-80gb": HardwareSpec(
        name="h100-80gb", **_H100_COMMON,
        hbm_gb_s=3350.0,       # H100 SXM5 datasheet: 3.35 TB/s HBM3
        memory_gb=80.0,        # datasheet
    ),
    "h200": HardwareSpec(
        name="h200", **_H100_COMMON,
        hbm_gb_s=4800.0,       # H200 SXM datasheet: 4.8 TB/s HBM3e
        memory_gb=141.0,       # datasheet: 141 GB
    ),
}

# Mixed-precision bookkeeping (facts of the Megatron/nanotron recipes, not hardware):
BYTES_ACT = 2                    # bf16 activations and TP/PP messages
BYTES_WEIGHT = 2                 # bf16 model weights
BYTES_GRAD = 4                   # fp32 main gradients (Megatron main_grad / nanotron
                                 # accumulate_grad_in_fp32), reduced in fp32 over DP
BYTES_OPTIM = 12                 # fp32 master weight + Adam m + v
OPTIMIZER_BYTES_PER_PARAM = 38   # fused Adam step + grad-norm + zero-grad, HBM traffic:
                                 # r/w master 8, m 8, v 8, read grad 4, write bf16 weight 2,
                                 # grad-norm read 4, zero grad 4
CE_BYTES_FWD = 24                # vocab-parallel cross entropy, bytes per logit (fp32 upcast,
CE_BYTES_BWD = 12                # max, exp, sum, softmax write) forward / backward


def hardware(name: str) -> HardwareSpec:
    key = name.lower()
    if key not in HARDWARE:
        raise ValueError(f"unknown GPU '{name}'; known: {', '.join(sorted(HARDWARE))}")
    return HARDWARE[key]


# ---------------------------------------------------------------------------------------------
# model shape and layout
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """A LLaMA-style decoder. The bottleneck modes use attn_rank / mlp_rank."""

    name: str
    num_layers: int
    hidden: int
    ffn: int
    heads: int
    query_groups: Optional[int] = None
    head_dim: Optional[int] = None
    vocab: int = 32000
    seq_length: int = 4096
    attn_rank: Optional[int] = None
    mlp_rank: Optional[int] = None
    tied_embeddings: bool = False

    @property
    def g(self) -> int:
        return self.query_groups or self.heads

    @property
    def e(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def r_attn(self) -> int:
        return self.attn_rank or max(1, self.hidden // 4)

    @property
    def r_mlp(self) -> int:
        return self.mlp_rank or max(1, self.hidden // 4)

    @classmethod
    def from_model_config(cls, m, name: str = "config") -> "ModelShape":
        """From ``megatron_boost.config.run.ModelConfig`` (or anything with its fields)."""
        attn_rank, mlp_rank = m.resolved_ranks()
        return cls(name=name, num_layers=m.num_layers, hidden=m.hidden_size,
                   ffn=m.ffn_hidden_size, heads=m.num_attention_heads,
                   query_groups=m.num_query_groups, head_dim=m.kv_channels,
                   vocab=m.vocab_size, seq_length=m.seq_length, attn_rank=attn_rank,
                   mlp_rank=mlp_rank, tied_embeddings=False)

    # parameters ------------------------------------------------------------------------------

    def _proj_dims(self) -> List[Tuple[str, int, int, str]]:
        """(name, d_in, d_out, group) of the seven projections of one layer."""
        d, f, qw, kvw = self.hidden, self.ffn, self.heads * self.e, self.g * self.e
        return [("q", d, qw, "attn"), ("k", d, kvw, "attn"), ("v", d, kvw, "attn"),
                ("o", qw, d, "attn"), ("gate", d, f, "mlp"), ("up", d, f, "mlp"),
                ("down", f, d, "mlp")]

    def layer_params(self, lowrank: bool) -> int:
        total = 2 * self.hidden  # two RMSNorm weights
        for _, din, dout, grp in self._proj_dims():
            r = self.r_attn if grp == "attn" else self.r_mlp
            total += r * (din + dout) if lowrank else din * dout
        return total

    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2) + self.hidden

    def total_params(self, lowrank: bool) -> int:
        return self.num_layers * self.layer_params(lowrank) + self.embedding_params()


@dataclass(frozen=True)
class Layout:
    mode: str = "boost"
    tp: int = 1
    pp: int = 1
    dp: int = 1
    micro_batch: int = 1
    global_batch: Optional[int] = None  # None: micro_batch · dp (one micro-batch per step)
    recompute: str = "none"
    vpp: int = 1
    distributed_optimizer: bool = False
    overlap_grad_reduce: bool = True
    gpus_per_node: Optional[int] = None  # None: the hardware default

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
# kernel cost functions
# ---------------------------------------------------------------------------------------------


def gemm_intensity(M: float, N: float, K: float) -> float:
    """Arithmetic intensity of a bf16 GEMM in FLOP per byte: 2MNK / (2(MK + KN + MN))."""
    return 1.0 / (1.0 / M + 1.0 / N + 1.0 / K)


def gemm_efficiency(M: float, N: float, K: float, hw: HardwareSpec) -> float:
    """Fraction of bf16 peak reached by an (M, N, K) GEMM: η_max · I / (I + I_half).

    ``I = MNK / (MN + NK + MK)`` is the GEMM's arithmetic intensity (FLOP/byte); for the
    token-major training GEMMs (M = b·s large) it is ≈ NK/(N + K), so a GEMM with a small N or K
    (the rank slice r/t of naive TP, or r and d/t of boost) has a low intensity and sits low
    on this saturating curve; a full-rank GEMM sits near η_max. I_half is of the order of the
    roofline ridge point (peak / HBM bandwidth).
    """
    intensity = gemm_intensity(M, N, K)
    return hw.gemm_eff_max * intensity / (intensity + hw.gemm_intensity_half)


def gemm_time(M: float, N: float, K: float, hw: HardwareSpec) -> float:
    if min(M, N, K) <= 0:
        return 0.0
    flops = 2.0 * M * N * K
    t_compute = flops / (hw.peak_bf16_tflops * 1e12 * hw.sustained_clock_ratio
                         * gemm_efficiency(M, N, K, hw))
    t_memory = BYTES_ACT * (M * K + K * N + M * N) / (hw.hbm_gb_s * 1e9 * hw.mem_eff)
    return max(t_compute, t_memory) + hw.kernel_launch_us * 1e-6


def attention_efficiency(head_dim: int, seq: int, hw: HardwareSpec) -> float:
    return (hw.attn_eff_max * head_dim / (head_dim + hw.attn_head_dim_half)
            * seq / (seq + hw.attn_seq_half))


def attention_flops_fwd(b: int, s: int, heads: int, e: int) -> float:
    """Causal flash attention forward: QKᵀ and PV, half of the s×s square computed."""
    return 4.0 * b * s * s * e * heads * 0.5


def attention_time(b: int, s: int, heads: int, e: int, hw: HardwareSpec) -> Tuple[float, float]:
    """(forward, backward) seconds of the attention core on ``heads`` local heads."""
    if heads <= 0:
        return 0.0, 0.0
    fl = attention_flops_fwd(b, s, heads, e)
    eff = attention_efficiency(e, s, hw)
    peak = hw.peak_bf16_tflops * 1e12 * hw.sustained_clock_ratio
    launch = hw.kernel_launch_us * 1e-6
    return fl / (peak * eff) + launch, 2.5 * fl / (peak * eff * hw.attn_bwd_ratio) + launch


def elementwise_time(nbytes: float, hw: HardwareSpec, kernels: int = 1) -> float:
    return nbytes / (hw.hbm_gb_s * 1e9 * hw.mem_eff) + kernels * hw.kernel_launch_us * 1e-6


def _link(hw: HardwareSpec, intra_node: bool, n: int = 2) -> Tuple[float, float]:
    """(bytes/s, α seconds) per GPU of the link an ``n``-GPU group uses."""
    if intra_node:
        bw = hw.nvlink_gb_s
        if hw.nvlink_peer_gb_s:  # switchless mesh: only the links to the group's peers count
            bw = min(bw, max(1, n - 1) * hw.nvlink_peer_gb_s)
        return bw * 1e9 * hw.nvlink_eff, hw.nvlink_latency_us * 1e-6
    return hw.ib_gb_s * 1e9 * hw.ib_eff, hw.ib_latency_us * 1e-6


def allreduce_time(nbytes: float, n: int, hw: HardwareSpec, intra_node: bool) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, alpha = _link(hw, intra_node, n)
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / bw


def allgather_time(nbytes: float, n: int, hw: HardwareSpec, intra_node: bool) -> float:
    """All-gather (or reduce-scatter) whose full, gathered buffer has ``nbytes``."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bw, alpha = _link(hw, intra_node, n)
    return (n - 1) * alpha + (n - 1) / n * nbytes / bw


def p2p_time(nbytes: float, hw: HardwareSpec, intra_node: bool) -> float:
    bw, alpha = _link(hw, intra_node)
    return alpha + nbytes / bw


# ---------------------------------------------------------------------------------------------
# per-layer work of each mode (per GPU, per token, forward)
# ---------------------------------------------------------------------------------------------


@dataclass
class Gemm:
    name: str
    N: float   # output width (per GPU)
    K: float   # contraction (per GPU)
    kind: str  # "dense" (full-rank), "A", "B", "head"


@dataclass
class Elem:
    name: str
    fwd_bytes: float  # per token
    bwd_bytes: float  # per token
    lowrank_recomputed: bool = True


@dataclass
class LayerWork:
    gemms: List[Gemm]
    attn_heads: float           # local heads the attention core runs on
    elems: List[Elem]
    coll_fwd: List[float]       # all-reduce widths, elements per token
    coll_bwd: List[float]
    saved: float                # activation elements per token kept for backward (no recompute)
    saved_attn_out: float       # the part dropped by selective recompute
    saved_input: float          # what full recompute keeps (the layer input)
    saved_lowrank: Optional[float]  # what lowrank recompute keeps (None: not applicable)
    params: float               # parameters per GPU


def _rmsnorm(name: str, w: float) -> Elem:
    return Elem(name, 4 * w, 6 * w)


def _residual(name: str, w: float) -> Elem:
    return Elem(name, 6 * w, 6 * w)


def _act(name: str, w: float) -> Elem:  # σ (SiLU) inside a bottleneck
    return Elem(name, 4 * w, 6 * w)


def layer_work(shape: ModelShape, mode: str, t: int) -> LayerWork:
    d, f, h, g, e = shape.hidden, shape.ffn, shape.heads, shape.g, shape.e
    qw, kvw = h * e, g * e
    ra, rm = shape.r_attn, shape.r_mlp
    if mode == "full":
        gemms = [Gemm("qkv", (qw + 2 * kvw) / t, d, "dense"), Gemm("proj", d, qw / t, "dense"),
                 Gemm("fc1", 2 * f / t, d, "dense"), Gemm("fc2", d, f / t, "dense")]
        elems = [_rmsnorm("input_norm", d), Elem("rope", 4 * (qw + kvw) / t, 4 * (qw + kvw) / t),
                 _residual("residual_attn", d), _rmsnorm("pre_mlp_norm", d),
                 Elem("swiglu", 6 * f / t, 10 * f / t), _residual("residual_mlp", d)]
        coll_fwd, coll_bwd = [d, d], [d, d]
        # saved for backward: norm inputs (2d), qkv / fc1 inputs (2d), q,k,v + attention
        # output (flash attention), fc1 output (2f/t), SwiGLU output (f/t)
        attn_out = qw / t
        saved = 4 * d + (qw + 2 * kvw) / t + attn_out + 3 * f / t
        saved_input, saved_lowrank = d, None
        params = (d * (qw + 2 * kvw) + qw * d + 3 * d * f) / t + 2 * d
    elif mode == "naive":
        gemms = [Gemm("A_qkv", 3 * ra / t, d, "A"), Gemm("B_q", qw, ra / t, "B"),
                 Gemm("B_k", kvw, ra / t, "B"), Gemm("B_v", kvw, ra / t, "B"),
                 Gemm("A_o", ra / t, qw, "A"), Gemm("B_o", d, ra / t, "B"),
                 Gemm("A_gate_up", 2 * rm / t, d, "A"), Gemm("B_gate", f, rm / t, "B"),
                 Gemm("B_up", f, rm / t, "B"), Gemm("A_down", rm / t, f, "A"),
                 Gemm("B_down", d, rm / t, "B")]
        sig = (4 * ra + 3 * rm) / t
        elems = [_rmsnorm("input_norm", d), _act("sigma_qkv", 3 * ra / t),
                 Elem("rope", 4 * (qw + kvw), 4 * (qw + kvw)), _act("sigma_o", ra / t),
                 _residual("residual_attn", d), _rmsnorm("pre_mlp_norm", d),
                 _act("sigma_gate_up", 2 * rm / t), Elem("swiglu", 6 * f, 10 * f),
                 _act("sigma_down", rm / t), _residual("residual_mlp", d)]
        coll_fwd = [qw + 2 * kvw, d, 2 * f, d]
        coll_bwd = [d, qw, d, f]
        # saved: norm in/out (2d each block), pre-σ and σ outputs (2·7r/t), q,k,v (full heads),
        # attention output, gate/up outputs (2f), SwiGLU output (f) — replicated on every rank
        attn_out = qw
        saved = 4 * d + 2 * sig + (qw + 2 * kvw) + attn_out + 3 * f
        saved_input = d
        # lowrank in naive mode: B outputs come out of an all-reduce, so (never re-running a
        # collective) keep x, the pre-σ slices, the all-reduced q,k,v, the mid residual and
        # the all-reduced gate/up; recompute σ, norms, RoPE, attention core, SwiGLU.
        saved_lowrank = d + sig + (qw + 2 * kvw) + d + 2 * f
        params = (ra * (3 * d + qw + 2 * kvw) + ra * (qw + d)
                  + rm * (2 * d + 2 * f) + rm * (f + d)) / t + 2 * d
    elif mode == "boost":
        gemms = [Gemm("A_qkv", 3 * ra, d / t, "A"), Gemm("B_q", qw / t, ra, "B"),
                 Gemm("B_k", kvw / t, ra, "B"), Gemm("B_v", kvw / t, ra, "B"),
                 Gemm("A_o", ra, qw / t, "A"), Gemm("B_o", d / t, ra, "B"),
                 Gemm("A_gate_up", 2 * rm, d / t, "A"), Gemm("B_gate", f / t, rm, "B"),
                 Gemm("B_up", f / t, rm, "B"), Gemm("A_down", rm, f / t, "A"),
                 Gemm("B_down", d / t, rm, "B")]
        sig = 4 * ra + 3 * rm  # σ on the all-reduced, replicated r-wide activations
        elems = [_rmsnorm("online_norm_attn", d / t), _act("sigma_qkv", 3 * ra),
                 Elem("rope", 4 * (qw + kvw) / t, 4 * (qw + kvw) / t), _act("sigma_o", ra),
                 _residual("residual_attn", d / t), _rmsnorm("online_norm_mlp", d / t),
                 _act("sigma_gate_up", 2 * rm), Elem("swiglu", 6 * f / t, 10 * f / t),
                 _act("sigma_down", rm), _residual("residual_mlp", d / t)]
        coll_fwd = [3 * ra + 1, ra, 2 * rm + 1, rm]
        coll_bwd = [3 * ra, ra, 2 * rm, rm]
        attn_out = qw / t
        saved = 4 * d / t + 2 * sig + (qw + 2 * kvw) / t + attn_out + 3 * f / t
        saved_input = d / t
        # DESIGN.md low-rank checkpointing: hidden-sharded layer input + the all-reduced
        # bottleneck activations (7r) + the two rms scalars
        saved_lowrank = d / t + sig + 2
        params = (ra * (3 * d + qw + 2 * kvw) + ra * (qw + d)
                  + rm * (2 * d + 2 * f) + rm * (f + d)) / t + 2 * d / t
    else:
        raise ValueError(f"unknown mode '{mode}'; one of {MODES}")
    return LayerWork(gemms=gemms, attn_heads=h / t if mode != "naive" else h, elems=elems,
                     coll_fwd=coll_fwd, coll_bwd=coll_bwd, saved=saved, saved_attn_out=attn_out,
                     saved_input=saved_input, saved_lowrank=saved_lowrank, params=params)


def tp_comm_elements_per_token(shape: ModelShape, mode: str) -> Dict[str, float]:
    """Per decoder layer: elements per token handed to TP all-reduces (DESIGN.md §2 table)."""
    w = layer_work(shape, mode, 2)
    return {"forward": sum(w.coll_fwd), "backward": sum(w.coll_bwd),
            "collectives": len(w.coll_fwd) + len(w.coll_bwd)}


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


def predict(shape: ModelShape, layout: Layout, hw: HardwareSpec) -> Prediction:
    """Iteration time, memory and communication of one layout (one GPU of the busiest stage)."""
    mode, t, p, dp, b = layout.mode, layout.tp, layout.pp, layout.dp, layout.micro_batch
    if mode not in MODES:
        raise ValueError(f"unknown mode '{mode}'; one of {MODES}")
    rc = layout.recompute or "none"
    if rc not in RECOMPUTE:
        raise ValueError(f"unknown recompute '{rc}'; one of {RECOMPUTE}")
    if rc == "lowrank" and mode == "full":
        raise ValueError("recompute 'lowrank' needs a bottleneck model (mode naive or boost)")
    if p > shape.num_layers:
        raise ValueError(f"pp ({p}) exceeds the number of layers ({shape.num_layers})")
    if mode in ("full", "boost") and (shape.heads % t or shape.g % t):
        raise ValueError(f"tp ({t}) must divide the attention heads ({shape.heads}) and query "
                         f"groups ({shape.g}) in mode {mode}")
    if mode != "full" and (shape.r_attn % t or shape.r_mlp % t):
        raise ValueError(f"tp ({t}) must divide the ranks ({shape.r_attn}, {shape.r_mlp})")
    m = layout.num_micro_batches
    v = max(1, layout.vpp or 1)
    s, n = shape.seq_length, b * shape.seq_length
    d, V = shape.hidden, shape.vocab
    gpn = layout.gpus_per_node or hw.gpus_per_node
    tp_intra = t <= gpn
    dp_intra = t * dp <= gpn
    pp_intra = t * dp * p <= gpn  # all stages of a pipeline inside one node

    w = layer_work(shape, mode, t)

    # ---- one layer, one micro-batch ---------------------------------------------------------
    def gemm_fb(gs: Iterable[Gemm]) -> Tuple[float, float]:
        fw = bw = 0.0
        for gm in gs:
            fw += gemm_time(n, gm.N, gm.K, hw)
            bw += gemm_time(n, gm.K, gm.N, hw) + gemm_time(gm.K, gm.N, n, hw)
        return fw, bw

    g_fwd, g_bwd = gemm_fb(w.gemms)
    gB_fwd, _ = gemm_fb([gm for gm in w.gemms if gm.kind != "A"])
    a_fwd, a_bwd = attention_time(b, s, int(w.attn_heads), shape.e, hw)
    el_fwd = sum(elementwise_time(n * x.fwd_bytes, hw) for x in w.elems)
    el_bwd = sum(elementwise_time(n * x.bwd_bytes, hw) for x in w.elems)
    c_fwd = sum(allreduce_time(n * wd * BYTES_ACT, t, hw, tp_intra) for wd in w.coll_fwd)
    c_bwd = sum(allreduce_time(n * wd * BYTES_ACT, t, hw, tp_intra) for wd in w.coll_bwd)

    if rc == "none":
        rec, rec_comm = 0.0, 0.0
    elif rc == "selective":
        rec, rec_comm = a_fwd, 0.0
    elif rc == "full":
        rec, rec_comm = g_fwd + a_fwd + el_fwd, c_fwd
    else:  # lowrank: everything but the A products and the collectives
        rec, rec_comm = gB_fwd + a_fwd + el_fwd, 0.0
        if mode == "naive":  # B outputs are all-reduced -> kept, not recomputed
            rec = a_fwd + el_fwd

    layer_f = {"gemm": g_fwd, "attention": a_fwd, "elementwise": el_fwd, "tp_comm": c_fwd}
    layer_b = {"gemm": g_bwd, "attention": a_bwd, "elementwise": el_bwd,
               "tp_comm": c_bwd + rec_comm, "recompute": rec}

    # ---- embedding (first stage) and head (last stage), one micro-batch ---------------------
    d_loc = d / t if mode == "boost" else d
    emb_f = {"elementwise": elementwise_time(n * d_loc * BYTES_ACT, hw)}
    emb_b = {"elementwise": elementwise_time(n * d_loc * (BYTES_ACT + BYTES_GRAD * 2), hw)}
    if mode != "boost":  # vocab-parallel embedding: all-reduce of d forward
        emb_f["tp_comm"] = allreduce_time(n * d * BYTES_ACT, t, hw, tp_intra)
    hf, hb = gemm_fb([Gemm("lm_head", V / t, d, "head")])
    head_f = {"gemm": hf,
              "elementwise": elementwise_time(n * (4 * d + CE_BYTES_FWD * V / t), hw, 6),
              "tp_comm": 3 * allreduce_time(n * 4, t, hw, tp_intra)}
    head_b = {"gemm": hb,
              "elementwise": elementwise_time(n * (6 * d + CE_BYTES_BWD * V / t), hw, 3)}
    if mode == "boost":  # all-gather the hidden shards forward, reduce-scatter backward
        head_f["tp_comm"] += allgather_time(n * d * BYTES_ACT, t, hw, tp_intra)
        head_b["tp_comm"] = allgather_time(n * d * BYTES_ACT, t, hw, tp_intra)
    else:  # copy-to-TP-region before the head: all-reduce of d backward
        head_b["tp_comm"] = allreduce_time(n * d * BYTES_ACT, t, hw, tp_intra)

    # ---- stages ------------------------------------------------------------------------------
    layers = _stage_layers(shape.num_layers, p)
    comp_keys = ("gemm", "attention", "elementwise", "tp_comm", "recompute")
    stages = []
    for i, nl in enumerate(layers):
        st = {k: nl * (layer_f.get(k, 0.0) + layer_b.get(k, 0.0)) for k in comp_keys}
        if i == 0:
            for k in comp_keys:
                st[k] += emb_f.get(k, 0.0) + emb_b.get(k, 0.0)
        if i == p - 1:
            for k in comp_keys:
                st[k] += head_f.get(k, 0.0) + head_b.get(k, 0.0)
        st["total"] = sum(st[k] for k in comp_keys)
        stages.append(st)
    busiest = max(range(p), key=lambda i: stages[i]["total"])
    t_pipe, bubble = pipeline_time([st["total"] for st in stages], m, v)

    # pipeline p2p: one activation (forward) and one gradient (backward) per micro-batch per
    # boundary; the boundary messages of the first/last micro-batch and each steady-state
    # exchange sit on the critical path
    p2p_bytes = n * d_loc * BYTES_ACT
    t_p2p = 0.0
    if p > 1:
        t_p2p = 2 * (m * v + p - 2) * p2p_time(p2p_bytes, hw, pp_intra)

    # ---- parameters, DP gradient reduction, optimizer ----------------------------------------
    emb_local = V * d / t
    stage_params = []
    for i, nl in enumerate(layers):
        sp = nl * w.params
        if i == 0:
            sp += emb_local
        if i == p - 1:
            if not shape.tied_embeddings or p > 1:
                sp += emb_local  # untied head, or the tied copy on the last stage
            sp += d / t if mode == "boost" else d  # final norm
        stage_params.append(sp)
    params_gpu = max(stage_params)
    grad_bytes = params_gpu * BYTES_GRAD
    t_dp_full = 0.0
    if dp > 1:
        if layout.distributed_optimizer:  # reduce-scatter fp32 grads + all-gather bf16 params
            t_dp_full = (allgather_time(grad_bytes, dp, hw, dp_intra)
                         + allgather_time(params_gpu * BYTES_WEIGHT, dp, hw, dp_intra))
        else:
            t_dp_full = allreduce_time(grad_bytes, dp, hw, dp_intra)
    last_bwd = stages[busiest]["total"] * 0.66  # backward share of one micro-batch
    if layout.overlap_grad_reduce and dp > 1:
        t_dp = max(t_dp_full * (1 - hw.dp_overlap), t_dp_full - last_bwd)
    else:
        t_dp = t_dp_full
    t_tied = 0.0
    if shape.tied_embeddings and p > 1:  # embedding-grad all-reduce between first/last stage
        t_tied = allreduce_time(emb_local * BYTES_GRAD, 2, hw, pp_intra)
    opt_params = params_gpu / (dp if layout.distributed_optimizer else 1)
    t_opt = elementwise_time(opt_params * OPTIMIZER_BYTES_PER_PARAM, hw, kernels=10)

    t_host = hw.step_overhead_ms * 1e-3
    total = t_pipe + t_p2p + t_dp + t_tied + t_opt + t_host
    bs = stages[busiest]
    breakdown = {
        "gemm": m * bs["gemm"], "attention": m * bs["attention"],
        "elementwise": m * bs["elementwise"], "tp_comm": m * bs["tp_comm"],
        "recompute": m * bs["recompute"], "pp_bubble": bubble, "pp_p2p": t_p2p,
        "dp_comm_exposed": t_dp + t_tied, "optimizer": t_opt, "step_overhead": t_host,
    }
    breakdown = {k: round(x, 6) for k, x in breakdown.items()}

    # ---- memory (per stage; report the fullest) -----------------------------------------------
    # 1F1B: stage i keeps the activations of min(m, p - i) micro-batches in flight; interleaving
    # (v > 1) adds (p - 1)/(p·v) of that (Megatron's estimate)
    per_layer = {"none": w.saved, "selective": w.saved - w.saved_attn_out,
                 "full": w.saved_input, "lowrank": w.saved_lowrank}[rc]
    opt_div = dp if layout.distributed_optimizer else 1
    stage_mem = []
    for i, (nl, sp) in enumerate(zip(layers, stage_params)):
        inflight = float(min(m, p - i))
        if v > 1 and p > 1:
            inflight *= 1 + (p - 1) / (p * v)
        act = n * BYTES_ACT * per_layer * nl * inflight
        if rc in ("full", "lowrank"):  # the working set of the one layer being recomputed
            act += n * BYTES_ACT * w.saved
        if i == 0:  # embedding output
            act += n * d_loc * BYTES_ACT * inflight
        if i == p - 1:  # bf16 logits + fp32 softmax of the vocab-parallel cross entropy
            act += n * (V / t) * (BYTES_ACT + 4)
        mem_i = {
            "weights": sp * BYTES_WEIGHT / 1e9,
            "grads": sp * BYTES_GRAD / 1e9,
            "optimizer": sp * BYTES_OPTIM / opt_div / 1e9,
            "activations": act / 1e9,
            "reserved": hw.reserved_memory_gb,
        }
        mem_i["total"] = sum(mem_i.values())
        stage_mem.append(mem_i)
    mem = max(stage_mem, key=lambda x: x["total"])
    mem = {k: round(x, 3) for k, x in mem.items()}
    nl_max = max(layers)

    # ---- communication volumes ------------------------------------------------------------------
    comm = {
        "tp_elements_per_token_per_layer_fwd": sum(w.coll_fwd) if t > 1 else 0,
        "tp_elements_per_token_per_layer_bwd": sum(w.coll_bwd) if t > 1 else 0,
        "tp_collectives_per_layer": (len(w.coll_fwd) + len(w.coll_bwd)) if t > 1 else 0,
        "tp_bytes_per_layer_fwd": (n * sum(w.coll_fwd) * BYTES_ACT) if t > 1 else 0,
        "tp_bytes_per_layer_bwd": (n * sum(w.coll_bwd) * BYTES_ACT) if t > 1 else 0,
        "tp_bytes_per_iteration": (m * nl_max * n * (sum(w.coll_fwd) + sum(w.coll_bwd))
                                   * BYTES_ACT) if t > 1 else 0,
        "dp_gradient_bytes": grad_bytes if dp > 1 else 0,
        "pp_p2p_bytes_per_microbatch": p2p_bytes if p > 1 else 0,
        "tp_link": "nvlink" if tp_intra else "network",
    }

    tokens = m * b * dp * s
    lowrank = mode != "full"
    # model FLOPs (no recompute): 6 per parameter per token for the layers and the LM head,
    # plus the causal attention core forward + backward (3.5 x forward)
    model_flops = (6 * tokens * (shape.num_layers * shape.layer_params(lowrank) + V * d)
                   + 3.5 * m * dp * shape.num_layers
                   * attention_flops_fwd(b, s, shape.heads, shape.e))
    mfu = model_flops / (total * layout.gpus * hw.peak_bf16_tflops * 1e12)
    layout_d = dataclasses.asdict(layout)
    layout_d["num_micro_batches"] = m
    layout_d["gpus_per_node"] = gpn
    return Prediction(
        model=shape.name, gpu=hw.name, mode=mode, layout=layout_d, iteration_s=round(total, 6),
        breakdown_s=breakdown, memory_gb=mem, comm=comm,
        fits=mem["total"] <= hw.memory_gb,
        tokens_per_s_per_gpu=round(tokens / total / layout.gpus, 2), mfu=round(mfu, 4))


# ---------------------------------------------------------------------------------------------
# the BOOST authors' published A100 table
# ---------------------------------------------------------------------------------------------

# Shapes of the authors' benchmark configs (github.com/Arcana-2236/BOOST, examples/ and
# .logging/iter_comp_mbz4/configs): LLaMA-2 shapes, MHA, rank = d/4, vocab 32000, tied
# embeddings. 3B: d=3072, f=8192, 26 layers, 24 heads (the authors' 3B, not OpenLLaMA-3B);
# 1B: f=5472 (CoLA's paper table says 5461).
PUBLISHED_SHAPES: Dict[str, ModelShape] = {
    "1B": ModelShape("1B", 24, 2048, 5472, 32, attn_rank=512, mlp_rank=512,
                     tied_embeddings=True),
    "3B": ModelShape("3B", 26, 3072, 8192, 24, attn_rank=768, mlp_rank=768,
                     tied_embeddings=True),
    "7B": ModelShape("7B", 32, 4096, 11008, 32, attn_rank=1024, mlp_rank=1024,
                     tied_embeddings=True),
    "13B": ModelShape("13B", 40, 5120, 13824, 40, attn_rank=1280, mlp_rank=1280,
                      tied_embeddings=True),
}

# (tp, pp, {mode: published seconds per iteration}); A100, micro-batch 4, seq 4096, bf16.
PUBLISHED_A100: Dict[str, Tuple[int, int, Dict[str, float]]] = {
    "1B": (1, 1, {"full": 0.85, "naive": 0.56, "boost": 0.59}),
    "3B": (2, 1, {"full": 1.14, "naive": 1.41, "boost": 0.78}),
    "7B": (4, 1, {"full": 1.06, "naive": 1.64, "boost": 0.72}),
    "13B": (4, 2, {"full": 2.07, "naive": 2.42, "boost": 1.30}),
}

PUBLISHED_SETUP = dict(gpu="a100-80gb-perlmutter", gpus_per_node=4, micro_batch=4, seq_length=4096,
                       dp=1, num_micro_batches=1, recompute="none")


def compare_published(hw: Optional[HardwareSpec] = None,
                      gpus_per_node: int = PUBLISHED_SETUP["gpus_per_node"]) -> List[Dict]:
    """Predicted vs published iteration seconds, one row per (model, mode)."""
    hw = hw or hardware(PUBLISHED_SETUP["gpu"])
    rows = []
    for name, (tp, pp, pub) in PUBLISHED_A100.items():
        shape = PUBLISHED_SHAPES[name]
        for mode in MODES:
            lay = Layout(mode=mode, tp=tp, pp=pp, dp=1, micro_batch=PUBLISHED_SETUP["micro_batch"],
                         global_batch=PUBLISHED_SETUP["micro_batch"], recompute="none",
                         gpus_per_node=gpus_per_node)
            pred = predict(shape, lay, hw)
            rows.append({"model": name, "gpu": hw.name, "gpus_per_node": gpus_per_node,
                         "tp": tp, "pp": pp, "gpus": tp * pp, "mode": mode,
                         "published_s": pub[mode], "predicted_s": round(pred.iteration_s, 4),
                         "ratio": round(pred.iteration_s / pub[mode], 4),
                         "within_15pct": abs(pred.iteration_s / pub[mode] - 1) <= 0.15,
                         "breakdown_s": pred.breakdown_s, "memory_gb": pred.memory_gb["total"],
                         "fits": pred.fits})
    return rows


def format_published(rows: List[Dict]) -> str:
    r0 = rows[0]
    out = [f"BOOST authors' A100 table vs this model ({r0['gpu']}, {r0['gpus_per_node']} "
           "GPUs/node; micro-batch 4, seq 4096, bf16, dp=1, 1 micro-batch/step): iteration s",
           f"{'model':<6}{'GPUs':>5}{'TP':>4}{'PP':>4}  "
           + "".join(f"{m + ' pred/pub (ratio)':>27}" for m in MODES)]
    by_model: Dict[str, Dict[str, Dict]] = {}
    for r in rows:
        by_model.setdefault(r["model"], {})[r["mode"]] = r
    for name, cells in by_model.items():
        r0 = next(iter(cells.values()))
        line = f"{name:<6}{r0['gpus']:>5}{r0['tp']:>4}{r0['pp']:>4}  "
        for mode in MODES:
            c = cells[mode]
            flag = ("" if c["within_15pct"] else "*") + ("" if c["fits"] else "!")
            line += (f"{c['predicted_s']:>10.3f} / {c['published_s']:<5.2f}"
                     f"({c['ratio']:.2f}){flag:2}")
        out.append(line)
    n_ok = sum(r["within_15pct"] for r in rows)
    out.append(f"{n_ok}/{len(rows)} cells within ±15 %  (* = outside; ! = this model's memory "
               f"estimate exceeds the GPU: " + ", ".join(
                   f"{r['model']} {r['mode']} {r['memory_gb']:.0f} GB" for r in rows
                   if not r["fits"]) + ")")
    speed = []
    for name, cells in by_model.items():
        pf, pn, pb = (cells[m]["predicted_s"] for m in MODES)
        qf, qn, qb = (cells[m]["published_s"] for m in MODES)
        speed.append(f"{name}: boost vs full {pf / pb:.2f}x (pub {qf / qb:.2f}x), "
                     f"vs naive {pn / pb:.2f}x (pub {qn / qb:.2f}x)")
    out.extend(speed)
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# layout search
# ---------------------------------------------------------------------------------------------


def _divisors(x: int) -> List[int]:
    return [i for i in range(1, x + 1) if x % i == 0]


def recommend(shape: ModelShape, gpus: int, hw: HardwareSpec, modes: Sequence[str] = MODES,
              global_batch: Optional[int] = None, top: int = 3,
              micro_batches: Sequence[int] = (1, 2, 4, 8),
              recomputes: Sequence[str] = RECOMPUTE,
              gpus_per_node: Optional[int] = None) -> Dict[str, List[Prediction]]:
    """The fastest layouts per mode that fit in memory (ranked by tokens/s over the cluster).

    TP ranges over powers of two up to a node; PP over divisors of the layer count; DP fills the
    rest; the distributed optimizer is on whenever dp > 1. All layouts share one global batch
    (default ``8 · gpus`` sequences, which every micro-batch ≤ 8 × dp divides); layouts whose
    micro-batch × dp does not divide it are skipped.
    """
    gpn = gpus_per_node or hw.gpus_per_node
    global_batch = global_batch or 8 * gpus
    out: Dict[str, List[Prediction]] = {}
    for mode in modes:
        cands = []
        for tp in (1, 2, 4, 8, 16):
            if tp > gpn or gpus % tp or shape.heads % tp or shape.g % tp:
                continue
            for pp in _divisors(gpus // tp):
                if pp > shape.num_layers:
                    continue
                dp = gpus // (tp * pp)
                for b in micro_batches:
                    if global_batch % (b * dp):
                        continue
                    gb = global_batch
                    for rc in recomputes:
                        if rc == "lowrank" and mode == "full":
                            continue
                        lay = Layout(mode=mode, tp=tp, pp=pp, dp=dp, micro_batch=b,
                                     global_batch=gb, recompute=rc,
                                     distributed_optimizer=dp > 1, gpus_per_node=gpn)
                        try:
                            pr = predict(shape, lay, hw)
                        except ValueError:
                            continue
                        if pr.fits:
                            cands.append(pr)
        cands.sort(key=lambda pr: pr.iteration_s)
        out[mode] = cands[:top]
    return out


def format_recommend(res: Dict[str, List[Prediction]], shape: ModelShape, gpus: int,
                     hw: HardwareSpec) -> str:
    gb = next((p.layout["global_batch"] for ps in res.values() for p in ps), None)
    lines = [f"Fastest layouts that fit: {shape.name} on {gpus} x {hw.name} "
             f"({hw.memory_gb:.0f} GB, seq {shape.seq_length}, global batch {gb})"]
    for mode, preds in res.items():
        lines.append(f"[{mode}]")
        if not preds:
            lines.append("  nothing fits")
        for pr in preds:
            L = pr.layout
            lines.append(
                f"  tp={L['tp']} pp={L['pp']} dp={L['dp']} mb={L['micro_batch']} "
                f"m={L['num_micro_batches']} recompute={L['recompute']:<9} "
                f"iter={pr.iteration_s:7.3f}s  tok/s/GPU={pr.tokens_per_s_per_gpu:9.0f}  "
                f"mem={pr.memory_gb['total']:6.1f} GB  MFU={pr.mfu:.2f}")
    return "\n".join(lines)


def format_prediction(pr: Prediction) -> str:
    L = pr.layout
    c = pr.comm
    lines = [
        f"[{pr.mode}] {pr.model} on {L['tp'] * L['pp'] * L['dp']} x {pr.gpu}: "
        f"tp={L['tp']} pp={L['pp']} dp={L['dp']} mb={L['micro_batch']} "
        f"m={L['num_micro_batches']} recompute={L['recompute']}",
        f"  iteration {pr.iteration_s:.3f} s   tokens/s/GPU {pr.tokens_per_s_per_gpu:.0f}   "
        f"MFU {pr.mfu:.2f}",
        "  time:   " + ", ".join(f"{k} {v:.3f}" for k, v in pr.breakdown_s.items() if v),
        "  memory: " + ", ".join(f"{k} {v:.2f}" for k, v in pr.memory_gb.items())
        + f" GB  ({'fits' if pr.fits else 'DOES NOT FIT'})",
        f"  comm:   TP per layer per token fwd {c['tp_elements_per_token_per_layer_fwd']:.0f} / "
        f"bwd {c['tp_elements_per_token_per_layer_bwd']:.0f} elements "
        f"({c['tp_bytes_per_layer_fwd'] / 2**30:.3f} / {c['tp_bytes_per_layer_bwd'] / 2**30:.3f}"
        f" GiB per layer, {c['tp_collectives_per_layer']} collectives, {c['tp_link']}); "
        f"DP grads {c['dp_gradient_bytes'] / 1e9:.2f} GB; PP p2p "
        f"{c['pp_p2p_bytes_per_microbatch'] / 1e6:.1f} MB/micro-batch",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="perf_model.py",
        description="Predict iteration time, per-GPU memory and communication of full / naive / "
                    "boost training on a GPU cluster (analytical roofline + alpha-beta model).")
    ap.add_argument("--config", help="YAML run config (megatron_boost.config.run); model shape, "
                                     "parallel layout and batch sizes are read from it")
    ap.add_argument("--gpus", type=int, help="GPUs in the cluster (default: tp·pp·dp of the "
                                             "config)")
    ap.add_argument("--gpu", default="a100-80gb", help=f"one of {', '.join(HARDWARE)}")
    ap.add_argument("--gpus-per-node", type=int, help="NVLink domain size (default: per GPU "
                                                      "type, 8)")
    ap.add_argument("--tp", type=int)
    ap.add_argument("--pp", type=int)
    ap.add_argument("--vpp", type=int)
    ap.add_argument("--micro-batch-size", type=int)
    ap.add_argument("--seq-length", type=int)
    ap.add_argument("--global-batch-size", type=int)
    ap.add_argument("--recompute", choices=RECOMPUTE)
    ap.add_argument("--distributed-optimizer", action="store_true", default=None)
    ap.add_argument("--modes", default="full,naive,boost")
    ap.add_argument("--compare-published", action="store_true",
                    help="reproduce the BOOST authors' A100 table (built-in shapes)")
    ap.add_argument("--recommend", action="store_true",
                    help="search TP/PP/micro-batch/recompute per mode for the fastest fits")
    ap.add_argument("--top", type=int, default=3)
    ap.add_argument("--json", help="write the results as JSON to this file")
    return ap


def _load_config(path: str):
    from megatron_boost.config.run import load_run_config  # heavy import (torch): lazy
    return load_run_config(path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    hw = hardware(args.gpu)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown mode '{m}' (one of {', '.join(MODES)})")
    result: Dict = {"gpu": hw.name, "hardware": dataclasses.asdict(hw)}

    if args.compare_published:
        rows = compare_published()
        print(format_published(rows))
        result["published_comparison"] = rows

    if args.config or args.recommend or not args.compare_published:
        if args.config:
            cfg = _load_config(args.config)
            shape = ModelShape.from_model_config(cfg.model, name=args.config)
            par, tr = cfg.parallel, cfg.training
            tp, pp, vpp = par.tp, par.pp, par.vpp or 1
            mb, gb = tr.micro_batch_size, tr.global_batch_size
            rc = tr.recompute or "none"
            dist_opt = par.use_distributed_optimizer
            overlap = par.overlap_grad_reduce
            cfg_dp = par.dp
        elif args.recommend or not args.compare_published:
            shape = PUBLISHED_SHAPES["7B"]
            shape = dataclasses.replace(shape, name="CoLA/LLaMA-7B", tied_embeddings=False)
            tp, pp, vpp, mb, gb, rc, dist_opt, overlap, cfg_dp = 1, 1, 1, 1, None, "none", \
                False, True, None
        if args.seq_length:
            shape = dataclasses.replace(shape, seq_length=args.seq_length)
        tp = args.tp or tp
        pp = args.pp or pp
        vpp = args.vpp or vpp
        mb = args.micro_batch_size or mb
        rc = args.recompute or rc
        if args.distributed_optimizer is not None:
            dist_opt = args.distributed_optimizer
        gpus = args.gpus or (tp * pp * (cfg_dp or 1))
        gb = args.global_batch_size or gb
        if not args.recommend:
            if gpus % (tp * pp):
                raise SystemExit(f"--gpus {gpus} is not a multiple of tp·pp = {tp * pp}")
            dp = gpus // (tp * pp)
            if gb and gb % (mb * dp):
                raise SystemExit(f"global batch {gb} is not a multiple of micro-batch {mb} × "
                                 f"dp {dp}")

        if args.recommend:
            res = recommend(shape, gpus, hw, modes=modes, global_batch=gb,
                            top=args.top, gpus_per_node=args.gpus_per_node)
            print(format_recommend(res, shape, gpus, hw))
            result["recommend"] = {m: [p.to_dict() for p in ps] for m, ps in res.items()}
        else:
            preds = []
            for mode in modes:
                mrc = rc
                if mrc == "lowrank" and mode == "full":
                    mrc = "full"  # the full-rank model has no bottleneck to checkpoint
                    print("note: mode full has no bottleneck; recompute lowrank -> full")
                lay = Layout(mode=mode, tp=tp, pp=pp, dp=dp, micro_batch=mb, global_batch=gb,
                             recompute=mrc, vpp=vpp, distributed_optimizer=dist_opt,
                             overlap_grad_reduce=overlap, gpus_per_node=args.gpus_per_node)
                pr = predict(shape, lay, hw)
                print(format_prediction(pr))
                preds.append(pr.to_dict())
            result["predictions"] = preds

    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
