"""Kernel and collective cost functions of the cluster performance model (seconds).

GEMMs on a saturating shape-efficiency curve over a roofline, flash attention, memory-bound
element-wise kernels, and alpha-beta ring collectives over NVLink or the network (the formulas
are listed in :mod:`megatron_boost.perf.model`'s module doc).
"""

from __future__ import annotations

from typing import Tuple

from megatron_boost.analysis.flops import attention_core_flops
from megatron_boost.perf.hardware import BYTES_ACT, HardwareSpec

__all__ = ["gemm_intensity", "gemm_efficiency", "gemm_time", "attention_efficiency",
           "attention_flops_fwd", "attention_time", "elementwise_time", "allreduce_time",
           "allgather_time", "p2p_time"]


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
    """Causal flash attention forward of ``b`` sequences: QKᵀ and PV, half of the s×s square
    computed."""
    return b * s * attention_core_flops(s, heads, e, causal=True)


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
