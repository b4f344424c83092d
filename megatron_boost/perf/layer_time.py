"""The op ledger in time: one decoder layer's forward and backward on a named device profile
(docs/design.md §17, docs/performance.md).

**The schedule** (:func:`layer_time`). The ledger's kernels run in the order the layer issued
them (``measure/ledger.py``), on two CUDA streams:

* the compute stream runs every kernel that is not a collective, one after another;
* ONE communication stream runs the collectives one after another (NCCL's stream of the TP
  group: two chunks' all-reduces never run side by side). A collective starts when it is
  issued (every kernel issued before it on the compute stream has ended: the data it reduces)
  and the communication stream is free.

The compute stream waits for a collective where the layer waits for it (its handle's
``wait``, or at once for a synchronous one) and before any kernel that reads its result (a
kernel that depends on it cannot run beside it, waited for or not). So only work issued
between a collective's start and its wait that does not depend on it hides it, and whatever
overlap a layer builds (pipelined chunks, halves of the micro-batch, asynchronous handles) is
priced from the recorded op stream alone. The layer's time is when both streams are done: the
compute stream's busy time plus the time it stood waiting (the exposed communication, charged
to the collective it waited for).

**The costs** (:class:`KernelCosts`): the cost functions of ``perf/kernels.py`` at one
:class:`~megatron_boost.perf.hardware.HardwareSpec`: element-wise, fused, cast and copy kernels
their bytes at the achieved HBM bandwidth, collectives the alpha-beta ring over NVLink, every
kernel a launch gap. GEMMs and the attention core either on a flat roofline (``flop_eff``:
the device profiles of :data:`DEVICE_PROFILES`, the issue's "989 TFLOP/s at 70 %") or on the
performance model's shape-efficiency curves (``flop_eff=None``: ``perf/model.py`` reads the
same schedule that way; its A100 curve is the one fitted to the published table).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from megatron_boost.measure.ledger import CollectiveEntry, LayerLedger
from megatron_boost.perf.hardware import HardwareSpec, hardware
from megatron_boost.perf.kernels import (allgather_time, allreduce_time, attention_efficiency,
                                         elementwise_time, gemm_time)

__all__ = ["DEVICE_PROFILES", "DEFAULT_PROFILE", "ROOFLINE_FLOP_EFF", "KernelCosts",
           "LayerTime", "layer_time", "profile_costs", "time_table", "TIME_CLASSES"]

#: The flat roofline's share of the dense bf16 peak that the layer's GEMMs and the flash
#: attention core sustain (assumption: large bf16 GEMMs with cuBLAS reach 65-75 % of an
#: H100 SXM's 989 TFLOP/s; the figure of the issue's roofline).
ROOFLINE_FLOP_EFF = 0.70

#: The named device profiles: each a GPU of ``perf/hardware.py``'s table (where every number
#: names its datasheet) on the flat roofline. HBM at ``mem_eff`` (80 %), TP collectives at the
#: NVLink bus bandwidth ``nvlink_gb_s · nvlink_eff`` (H100 SXM: 450 · 0.8 = 360 GB/s).
DEVICE_PROFILES: Dict[str, str] = {
    "h100-sxm": "h100-80gb",
    "a100-sxm": "a100-80gb",
    "h200-sxm": "h200",
    "b200": "b200",
}
DEFAULT_PROFILE = "h100-sxm"

#: The classes of the compute stream's time, in report order.
TIME_CLASSES = ("gemm", "attention", "traffic")


@dataclass(frozen=True)
class KernelCosts:
    """Seconds of one ledger kernel, or one collective, on ``hw`` in a TP group of ``tp``
    (module docstring)."""

    hw: HardwareSpec
    tp: int
    flop_eff: Optional[float] = ROOFLINE_FLOP_EFF
    """The flat share of the bf16 peak for GEMMs and attention; None: the shape curves."""
    intra_node: bool = True

    @property
    def launch_s(self) -> float:
        return self.hw.kernel_launch_us * 1e-6

    def kernel(self, k) -> float:
        if k.kind == "gemm":
            return self._gemm(k)
        if k.kind == "attention" and k.flops:
            return self._attention(k)
        return elementwise_time(k.bytes, self.hw, kernels=1)

    def _gemm(self, k) -> float:
        if self.flop_eff is None:
            m, n, kk = _mnk(k)
            return gemm_time(m, n, kk, self.hw)
        hw = self.hw
        compute = k.flops / (hw.peak_bf16_tflops * 1e12 * self.flop_eff)
        memory = k.bytes / (hw.hbm_gb_s * 1e9 * hw.mem_eff)
        return max(compute, memory) + self.launch_s

    def _attention(self, k) -> float:
        hw = self.hw
        if self.flop_eff is not None:
            rate = hw.peak_bf16_tflops * 1e12 * self.flop_eff
        else:  # the performance model's flash-attention curve (perf/kernels.py)
            _, _, s, e = k.shapes[0]
            rate = (hw.peak_bf16_tflops * 1e12 * hw.sustained_clock_ratio
                    * attention_efficiency(e, s, hw)
                    * (hw.attn_bwd_ratio if k.phase == "bwd" else 1.0))
        return k.flops / rate + self.launch_s

    def collective(self, c: CollectiveEntry) -> float:
        if c.kind == "all_reduce":
            return allreduce_time(c.bytes, self.tp, self.hw, self.intra_node)
        return allgather_time(c.bytes, self.tp, self.hw, self.intra_node)  # ring: either way


def _mnk(k) -> Tuple[float, float, float]:
    """(M, N, K) of a GEMM kernel from its operands' shapes (the last two of ``shapes``:
    mm's [M, K] @ [K, N], addmm's bias first, bmm's batch folded into M)."""
    a, b = k.shapes[-2], k.shapes[-1]
    batch = a[0] if len(a) == 3 else 1
    return batch * a[-2], b[-1], a[-1]


def profile_costs(profile: str, tp: int) -> KernelCosts:
    """The flat-roofline costs of a named device profile (:data:`DEVICE_PROFILES`)."""
    if profile not in DEVICE_PROFILES:
        raise ValueError(f"unknown device profile '{profile}'; known: "
                         f"{', '.join(DEVICE_PROFILES)}")
    return KernelCosts(hardware(DEVICE_PROFILES[profile]), tp)


@dataclass
class LayerTime:
    """One layer's forward and backward in time (seconds), per phase where keyed by phase."""

    busy: Dict[str, Dict[str, float]]
    """phase -> class (:data:`TIME_CLASSES`) -> seconds on the compute stream."""
    exposed: Dict[str, float]
    """phase -> seconds the compute stream waited for the communication stream."""
    launches: int
    """Kernels on the compute stream (each carries a launch gap)."""
    launch_s: float
    collectives: List[Dict] = field(default_factory=list)
    """Per collective: phase, kind, scope, MiB, async, seconds on the link, exposed seconds."""

    def seconds(self, cls: str, phase: Optional[str] = None) -> float:
        phases = [phase] if phase else list(self.busy)
        if cls == "exposed_comm":
            return sum(self.exposed.get(p, 0.0) for p in phases)
        return sum(self.busy[p].get(cls, 0.0) for p in phases)

    def total(self, phase: Optional[str] = None) -> float:
        return sum(self.seconds(c, phase) for c in TIME_CLASSES + ("exposed_comm",))

    @property
    def flop_time(self) -> float:
        """The GEMMs' and the attention core's time: what the layer would take with nothing
        else on the critical path."""
        return self.seconds("gemm") + self.seconds("attention")

    @property
    def ratio(self) -> float:
        return self.total() / self.flop_time if self.flop_time else float("inf")


class _Streams:
    """The two streams' clocks while :func:`layer_time` walks the op stream."""

    def __init__(self):
        self.compute = self.comm = 0.0
        self.ends: Dict[int, float] = {}       # collective kernel index -> its end
        self.exposed_by: Dict[int, float] = {}

    def wait_for(self, index: int) -> float:
        """The compute stream waits until collective ``index`` ends: the seconds it stood."""
        stood = max(0.0, self.ends.get(index, 0.0) - self.compute)
        self.compute += stood
        self.exposed_by[index] = self.exposed_by.get(index, 0.0) + stood
        return stood


def layer_time(ledger: LayerLedger, costs: KernelCosts) -> LayerTime:
    """The layer's ledger on two streams (module docstring)."""
    entries = {c.issued_at: c for c in ledger.collectives}
    waits: Dict[int, List[int]] = {}
    for c in ledger.collectives:
        waits.setdefault(c.waited_at if c.waited_at is not None else len(ledger.kernels),
                         []).append(c.issued_at)
    s = _Streams()
    busy = {p: dict.fromkeys(TIME_CLASSES, 0.0) for p in ("fwd", "bwd")}
    exposed = {"fwd": 0.0, "bwd": 0.0}
    launches = 0
    for i, k in enumerate(ledger.kernels + [None]):
        phase = k.phase if k is not None else "bwd"
        for index in waits.get(i, []) + (list(k.deps) if k is not None else []):
            exposed[phase] += s.wait_for(index)
        if k is None:
            break
        if k.kind == "collective":
            start = max(s.compute, s.comm)
            s.comm = s.ends[i] = start + costs.collective(entries[i])
            continue
        seconds = costs.kernel(k)
        s.compute += seconds
        cls = k.kind if k.kind in ("gemm", "attention") else "traffic"
        busy[k.phase][cls] += seconds
        launches += 1
    return LayerTime(busy=busy, exposed=exposed, launches=launches,
                     launch_s=launches * costs.launch_s,
                     collectives=[_collective_row(c, costs, s) for c in ledger.collectives])


def _collective_row(c: CollectiveEntry, costs: KernelCosts, s: _Streams) -> Dict:
    return {"phase": c.phase, "kind": c.kind, "scope": c.scope, "mib": c.bytes / 2 ** 20,
            "async": c.async_op, "link_s": costs.collective(c),
            "exposed_s": s.exposed_by.get(c.issued_at, 0.0)}


def time_table(rows: List[Tuple[str, LayerTime]], profile: str) -> str:
    """One row per layer: its times in ms and shares, and total / FLOP time."""
    lines = [f"| layer ({profile}) | total ms | GEMM ms | attention ms | memory traffic ms | "
             f"exposed comm ms | of which launches ms | total / FLOP time |",
             "|---|---|---|---|---|---|---|---|"]
    for label, t in rows:
        total = t.total()

        def cell(cls):
            return f"{t.seconds(cls) * 1e3:.2f} ({t.seconds(cls) / total:.0%})"

        lines.append(f"| {label} | {total * 1e3:.2f} | {cell('gemm')} | {cell('attention')} | "
                     f"{cell('traffic')} | {cell('exposed_comm')} | {t.launch_s * 1e3:.2f} | "
                     f"{t.ratio:.2f}x |")
    return "\n".join(lines)
