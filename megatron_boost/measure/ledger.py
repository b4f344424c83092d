"""The per-layer op ledger: what one decoder layer's forward and backward launch and move, on
one TP rank, at a run's real per-rank shapes (docs/design.md §17).

**How it is measured.** One decoder layer is built exactly as the model builds it
(:func:`~megatron_boost.measure.layer_comm.build_decoder_layer`: the mode's layer spec, megatron's
``TransformerLayer``), with its parameters and inputs as torch ``FakeTensor`` s: every tensor
has its real shape, dtype, strides and device, and no storage. The process plays TP rank 0 of
a group of ``t`` ranks of torch's fake process group (collectives are issued, with their real
sizes, and complete at once). So a 7B layer at B·S = 16384 tokens is measured at its full size,
exactly, in seconds and without allocating it: nothing is scaled. The layer runs forward, with
RoPE as the GPT model applies it, and backward, under a ``TorchDispatchMode`` that sees every
ATen operator autograd issues; each is one entry (:class:`Kernel`) of a class:

* ``gemm``: mm, bmm, addmm, baddbmm, and their in-place forms (FLOPs 2·M·N·K);
* ``attention``: the attention core's kernels (SDPA's, flash);
* ``elementwise``: pointwise and reduction kernels, memsets included;
* ``cast``: dtype conversions;
* ``copy``: layout copies: cat, clone, copy_, stack, and the add of a constant 0;
* ``fused``: a fused region, one kernel on CUDA (below);
* ``collective``: the c10d collectives, with their bytes, whether they were issued
  asynchronously, where they were waited for, and the GEMM FLOPs issued between an
  asynchronous one's start and its wait that do not read its result (each kernel lists the
  collectives whose result it reads, ``Kernel.deps``; the time each keeps the layer waiting:
  ``perf/layer_time.py``).

Views, allocations and metadata are not kernels. A kernel reads each distinct tensor argument
once and writes each result (numel × element size; an in-place operator writes its mutated
argument, ``copy_`` and fills do not read it).

**The CUDA op graph.** The ledger counts what a GPU launches, which is not what the CPU runs
where the GPU path fuses: the layers' own regions (``parallel/fusion.py``), which megatron's
``jit_fuser`` compiles into one kernel each on CUDA, and four kernels of megatron, Transformer
Engine and flash attention that the CPU cannot run, which the ledger stands in for while it
records (``measure/kernel_models.py``): TE's fused RoPE (``apply_rope_fusion``), a fused
RMSNorm (TE's ``TENorm``), megatron's fused SwiGLU (``bias_activation_fusion``, full rank) and
a flash attention kernel. Each is one entry forward and one backward, reading its inputs and
writing its results; the eager kernels it replaces are counted too (``eager_kernels``), so the
CPU's own count is also reported.

**DDP's gradient accumulation.** Each parameter gets the fp32 ``main_grad`` megatron's DDP
gives it and DDP's hook (``measure/grad_accumulation.py``): its ``main_grad.add_`` is one
backward entry (scope ``ddp.main_grad``) unless the layer accumulated into ``main_grad`` in its
own GEMM and set ``grad_added_to_main_grad`` (megatron's linears with
``gradient_accumulation_fusion``, apex's wgrad GEMM stood in for), so the count follows the
layer's code.

**The output gradient** is handed in as the next layer's input gradient (boost: the next
layer's residual tap, ``parallel/residual.py``): the ledger is a layer inside the decoder, whose
residual gradient its A sides' dgrad GEMMs add; the last layer's, from the final norm, is copied
once first (one more kernel).

**Saved activations.** The bytes of the storages autograd keeps for backward
(``measure/memory.py``, parameters excluded), with the module that saved each, and the fp32
ones wider than one value per token listed apart.

**Scopes.** Every entry carries the module of the layer that issued it (``self_attention.
linear_qkv``, ``mlp``, ``layer`` for the layer's own operators). Backward entries take the
module whose forward created the autograd node that runs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from megatron_boost.config.layout import Layout
from megatron_boost.config.modes import TPMode
from megatron_boost.config.placement import Tensor, tensor_local_shape
from megatron_boost.config.run import ModelConfig, RunConfig
from megatron_boost.config.shape import ModelShape, check_mode
from megatron_boost.measure.kernel_models import CUDA_KERNEL_MODELS, cuda_kernel_models
from megatron_boost.measure.op_recorder import Kernel, Scopes, recorder_class
from megatron_boost.runtime.backends import FusedKernels, resolve_fusions

# The ledger's records are read without torch (the perf model and its CLI import them): what
# needs torch or megatron-core (building and running the layer) is imported where it runs.

__all__ = ["KINDS", "TRAFFIC_KINDS", "Kernel", "CollectiveEntry", "LayerLedger", "LedgerSpec",
           "CUDA_KERNEL_MODELS", "in_attention", "layer_ledger", "measure_ledgers",
           "ledger_in_process", "layer_input_shape",
           "ledger_table", "ledger_json", "ledger_from_dict", "spec_label"]

#: The kernel classes, in report order.
KINDS = ("gemm", "attention", "elementwise", "fused", "cast", "copy", "collective")
#: The memory-bound classes: "elementwise + copy traffic".
TRAFFIC_KINDS = ("elementwise", "fused", "cast", "copy")
#: The attention core's module, and the stand-ins of the kernels of RoPE (identical in every
#: mode): "outside attention" is the rest, the layer's projections, norms, MLP product,
#: residual adds and the attention module's own glue (splitting q, k, v).
CORE_ATTENTION_SCOPE = "self_attention.core_attention"
ROPE_KERNELS = ("rope", "rope_backward")


def in_attention(kernel: "Kernel") -> bool:
    """Whether a kernel is the attention core's or RoPE's."""
    return kernel.scope == CORE_ATTENTION_SCOPE or kernel.name in ROPE_KERNELS


@dataclass
class CollectiveEntry:
    """One collective of the layer, with what may hide it."""

    phase: str
    kind: str
    scope: str
    bytes: int
    width: int
    async_op: bool
    overlap_flops: float
    """GEMM FLOPs issued between its start and its wait that do not read its result (0 for a
    synchronous one): what can run beside it."""
    overlap_bytes: int
    """Bytes moved by the other such kernels (independent of it) between start and wait."""
    issued_at: int = 0
    """Its index in the ledger's kernels (the op stream's order)."""
    waited_at: Optional[int] = None
    """The index of the first kernel issued after its wait (None: not waited for in the
    layer); a synchronous one's is the next kernel's."""

    @property
    def exposed(self) -> bool:
        """Nothing can run beside it: synchronous, or waited for before any GEMM that does
        not depend on it (how long it waits: ``perf/layer_time.py``)."""
        return not self.async_op or self.overlap_flops == 0


@dataclass
class LayerLedger:
    """The ledger of one decoder layer on one TP rank (module docstring)."""

    spec: "LedgerSpec"
    kernels: List[Kernel]
    collectives: List[CollectiveEntry]
    saved_bytes: int
    saved_by_scope: Dict[str, int]
    saved_fp32_wide: List[Dict[str, Any]]
    """fp32 storages saved for backward with more than one value per token."""

    @property
    def tokens(self) -> int:
        return self.spec.micro_batch * self.spec.seq_length

    def select(self, phase: Optional[str] = None, kind: Optional[str] = None,
               outside_attention: bool = False) -> List[Kernel]:
        return [k for k in self.kernels
                if (phase is None or k.phase == phase) and (kind is None or k.kind == kind)
                and not (outside_attention and in_attention(k))]

    def count(self, phase=None, kind=None, outside_attention=False) -> int:
        return len(self.select(phase, kind, outside_attention))

    def bytes(self, phase=None, kind=None, outside_attention=False) -> int:
        return sum(k.bytes for k in self.select(phase, kind, outside_attention))

    def traffic(self, phase=None, outside_attention=False) -> int:
        """Bytes of the memory-bound kernels (:data:`TRAFFIC_KINDS`)."""
        return sum(self.bytes(phase, kind, outside_attention) for kind in TRAFFIC_KINDS)

    def layout_copies(self, outside_attention: bool = True) -> List[Kernel]:
        """The layout copies (class ``copy``), by default those outside the attention core and
        megatron's RoPE."""
        return self.select(kind="copy", outside_attention=outside_attention)

    def ddp_accumulation(self) -> List[Kernel]:
        """The kernels of DDP's hook adding gradients into ``main_grad``
        (``measure/grad_accumulation.py``)."""
        from megatron_boost.measure.grad_accumulation import DDP_SCOPE

        return [k for k in self.kernels if k.scope == DDP_SCOPE]

    def grad_accumulation(self) -> List[Kernel]:
        """Every kernel adding a weight gradient into ``main_grad`` outside a GEMM: DDP's
        hook's, and a layer's own in-place adds (the fused norm's γ-scaled A factors)."""
        return [k for k in self.kernels if k.accumulates and k.kind != "gemm"]

    def gemm_flops(self, phase=None) -> float:
        return sum(k.flops for k in self.select(phase, "gemm"))

    def eager_count(self, phase=None) -> int:
        return sum(k.eager_kernels for k in self.select(phase))

    def summary(self) -> Dict[str, Any]:
        """Per phase and class: kernels, bytes read and written; totals; collectives; saved."""
        out: Dict[str, Any] = {}
        for phase in ("fwd", "bwd", None):
            key = phase or "total"
            out[key] = {kind: {"kernels": self.count(phase, kind),
                               "read": sum(k.read for k in self.select(phase, kind)),
                               "write": sum(k.write for k in self.select(phase, kind))}
                        for kind in KINDS}
            out[key]["kernels"] = self.count(phase)
            out[key]["eager_kernels"] = self.eager_count(phase)
            out[key]["traffic_bytes"] = self.traffic(phase)
            out[key]["gemm_flops"] = self.gemm_flops(phase)
        out["traffic_bytes_outside_attention"] = self.traffic(outside_attention=True)
        out["kernels_outside_attention"] = self.count(outside_attention=True)
        out["layout_copies_outside_attention"] = len(self.layout_copies())
        out["ddp_accumulation_kernels"] = len(self.ddp_accumulation())
        out["ddp_accumulation_bytes"] = sum(k.bytes for k in self.ddp_accumulation())
        out["collectives_exposed"] = sum(c.exposed for c in self.collectives)
        out["collectives_exposed_bytes"] = sum(c.bytes for c in self.collectives if c.exposed)
        out["saved_bytes"] = self.saved_bytes
        out["saved_fp32_wide_bytes"] = sum(s["bytes"] for s in self.saved_fp32_wide)
        return out

    def to_dict(self) -> Dict[str, Any]:
        spec = self.spec.to_dict()
        return {"spec": spec, "tokens": self.tokens, "summary": self.summary(),
                "collectives": [dataclasses.asdict(c) | {"exposed": c.exposed}
                                for c in self.collectives],
                "saved_by_scope": self.saved_by_scope, "saved_fp32_wide": self.saved_fp32_wide,
                "kernels": [dataclasses.asdict(k) for k in self.kernels]}


@dataclass(frozen=True)
class LedgerSpec:
    """What to measure: one layer of ``shape`` in ``mode`` on one of ``tp`` ranks."""

    shape: ModelShape
    layout: Layout = Layout()
    """The mode, the TP size and (full rank) megatron's sequence parallelism, on only where
    the layout says true; its pipeline and data sizes play no part in one layer."""
    micro_batch: int = 1
    seq_length: int = 2048
    dtype: str = "bf16"
    recompute: Optional[str] = None
    """The layer's recompute policy: None or 'lowrank' (the bottleneck modes' layer-level one)."""
    overlap_chunks: int = 1
    """``parallel.bottleneck_overlap_chunks`` (boost)."""
    interleave_halves: bool = False
    """``parallel.interleave_halves`` (boost): the layer runs two halves of the micro-batch."""
    bias_activation_fusion: Optional[bool] = None
    """Full rank's fused SwiGLU; None: as a CUDA run resolves it (on)."""

    def to_dict(self) -> Dict[str, Any]:
        """The flat form of the JSON reports (tools/layer_ops.py --json), the layout's fields in
        their published places."""
        fields = dataclasses.asdict(self)
        fields.update(mode=self.layout.mode, tp=self.layout.tp,
                      sequence_parallel=bool(self.layout.sequence_parallel))
        return {name: fields[name] for name in _SPEC_JSON_ORDER}


#: The spec's keys in the JSON reports, in their published order.
_SPEC_JSON_ORDER = ("shape", "mode", "tp", "micro_batch", "seq_length", "dtype",
                    "sequence_parallel", "recompute", "overlap_chunks", "bias_activation_fusion",
                    "interleave_halves")


# ---------------------------------------------------------------------------------------------
# building and running one layer
# ---------------------------------------------------------------------------------------------


def _run_config(spec: LedgerSpec):
    """The run configuration of ``spec``: its shape, mode, layout and precision."""
    shape = spec.shape
    cfg = RunConfig()
    cfg.model = ModelConfig(
        num_layers=1, hidden_size=shape.hidden, ffn_hidden_size=shape.ffn,
        num_attention_heads=shape.heads, num_query_groups=shape.query_groups,
        kv_channels=shape.head_dim, vocab_size=shape.vocab or 32000,
        seq_length=spec.seq_length, attn_rank=shape.attn_rank, mlp_rank=shape.mlp_rank,
        bottleneck_activation=shape.bottleneck_activation,
        mlp_gate_activation=shape.mlp_gate_activation, attention_backend="sdpa",
        bias_activation_fusion=(spec.bias_activation_fusion
                                if spec.layout.mode is TPMode.FULL else None))
    cfg.parallel.mode, cfg.parallel.tp = spec.layout.mode.value, spec.layout.tp
    cfg.parallel.sequence_parallel = bool(spec.layout.sequence_parallel)
    cfg.parallel.bottleneck_overlap_chunks = spec.overlap_chunks
    cfg.parallel.interleave_halves = spec.interleave_halves
    cfg.training.micro_batch_size = spec.micro_batch
    cfg.training.global_batch_size = spec.micro_batch
    cfg.training.precision = spec.dtype
    cfg.training.recompute = spec.recompute
    cfg.training.device = "cpu"
    return cfg.validate()


def _cuda_fusions(spec: LedgerSpec):
    """The fusion settings a CUDA run with Transformer Engine resolves for ``spec`` (the ledger
    counts the CUDA op graph); RoPE's and the norms' fused kernels and apex's wgrad GEMM are the
    stand-ins."""
    # apex's wgrad kernel too (megatron's linears accumulate into main_grad in their GEMM;
    # the kernel's stand-in: measure/kernel_models.py)
    fusions = resolve_fusions("cuda", "te", FusedKernels(te=True, wgrad_accumulation=True),
                              mode=spec.layout.mode,
                              bias_activation_fusion=spec.bias_activation_fusion)
    # the stand-in replaces TE's RoPE kernel, which the CPU cannot call
    fusions["apply_rope_fusion"] = (False, "the ledger's stand-in for TE's fused RoPE")
    return tuple((name, on, why) for name, (on, why) in fusions.items())


@contextlib.contextmanager
def _fake_tp_group(tp: int) -> Iterator[Any]:
    """This process as TP rank 0 of ``tp`` ranks of torch's fake process group, with
    megatron's parallel state over it; both torn down on exit."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the op ledger needs a process without a process group (it plays "
                           "one rank of a fake one); run it from a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
                                                 create_gloo_process_groups=False)
        yield parallel_state.get_tensor_model_parallel_group()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def layer_input_shape(spec: LedgerSpec) -> Tuple[int, int, int]:
    """The layer's input on one rank: the residual stream [s, b, d] split as the placement
    table says (boost: along d; full with sequence parallelism: along s)."""
    stream = (spec.seq_length, spec.micro_batch, spec.shape.hidden)
    return tensor_local_shape(spec.layout.mode, Tensor.STREAM, stream, spec.layout.tp,
                              sequence_parallel=bool(spec.layout.sequence_parallel))


def _build(spec: LedgerSpec):
    """(layer, rotary embedding, transformer config) of ``spec``, parameters uninitialised
    (the ledger's tensors are fake)."""
    import dataclasses as dc

    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_boost.measure.layer_comm import build_decoder_layer
    from megatron_boost.config.resolved import resolve_run, to_transformer_config

    cfg = _run_config(spec)
    run = resolve_run(cfg, vocab_size=cfg.model.vocab_size)
    run = dc.replace(run, fusions=_cuda_fusions(spec))
    config = to_transformer_config(run, perform_initialization=False)
    default = torch.get_default_dtype()
    # every parameter in the run's dtype, as megatron's Float16Module leaves the model it wraps
    # (a FakeTensor parameter cannot be converted after the fact)
    torch.set_default_dtype(config.params_dtype)
    try:
        layer = build_decoder_layer(config)
    finally:
        torch.set_default_dtype(default)
    layer.train()
    rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0,
                           rotary_base=cfg.model.rotary_base, use_cpu_initialization=True)
    return layer, rope, config


def _collective_entries(kernels: List[Kernel], log) -> List[CollectiveEntry]:
    """Each recorded collective with its kernel's scope and what ran before its wait."""
    at = [i for i, k in enumerate(kernels) if k.kind == "collective"]
    if len(at) != len(log.records):
        raise RuntimeError(f"op ledger: {len(at)} collective kernels but {len(log.records)} "
                           f"recorded collectives")
    out = []
    for index, rec in zip(at, log.records):
        end = rec.waited_at if rec.waited_at is not None else len(kernels)
        between = [k for k in (kernels[index + 1:end] if rec.async_op else [])
                   if k.kind != "collective" and index not in k.deps]
        out.append(CollectiveEntry(
            phase=rec.direction, kind=rec.kind, scope=kernels[index].scope, bytes=rec.nbytes,
            width=rec.width, async_op=rec.async_op,
            overlap_flops=sum(k.flops for k in between if k.kind == "gemm"),
            overlap_bytes=sum(k.bytes for k in between), issued_at=index,
            waited_at=rec.waited_at))
    return out


def _previous_layer_output(x):
    """x as a layer inside the decoder receives it: the previous layer's output, whose gradient
    that layer takes on (boost: adds in place, ``parallel/residual.py``), not a leaf's ``.grad``
    (which autograd copies where another holds the buffer: the ledger's output gradient, which
    boost's residual gradient carries down to the input)."""
    import torch

    class PreviousLayer(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.detach()

        @staticmethod
        def backward(ctx, grad):
            return None

    return PreviousLayer.apply(x)


def _fp32_wide(saved, tokens: int) -> List[Dict[str, Any]]:
    """The fp32 activations [s, b, w > 1] or [s·b, w > 1] saved (one value per token, like
    1/rms, is not; nor RoPE's frequencies [s, 1, 1, e], one row per position)."""
    import torch

    def per_token(shape) -> bool:
        rows = shape[0] * shape[1] if len(shape) == 3 else shape[0] if len(shape) == 2 else 0
        return rows == tokens and shape[-1] > 1

    return [{"scope": s.label, "shape": list(s.shape), "bytes": s.nbytes}
            for s in saved.storages.values()
            if s.dtype == torch.float32 and per_token(s.shape)]


def ledger_in_process(spec: LedgerSpec) -> LayerLedger:
    """Measure ``spec`` in this process (which must have no process group)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_boost.measure.collectives import record_collectives
    from megatron_boost.measure.grad_accumulation import ddp_grad_accumulation
    from megatron_boost.measure.memory import SavedActivations
    from megatron_boost.parallel.fusion import observe_regions
    from megatron_boost.parallel.residual import as_next_layer_input

    with _fake_tp_group(spec.layout.tp) as tp_group, FakeTensorMode(allow_non_fake_inputs=True), \
            cuda_kernel_models():  # before the build: megatron's linears check apex's kernel
        layer, rope, config = _build(spec)
        x = _previous_layer_output(torch.empty(layer_input_shape(spec),
                                               dtype=config.params_dtype, requires_grad=True))
        freqs = rope(spec.seq_length)  # [s, 1, 1, e], as GPTModel hands it to its layers
        scopes = Scopes(layer)
        recorder = recorder_class()(scopes)
        with observe_regions(recorder), ddp_grad_accumulation(layer, scopes), \
                record_collectives(tp_group, clock=lambda: len(recorder.kernels)) as log:
            with SavedActivations(exclude=layer.parameters(),
                                  label=lambda: scopes.current) as saved, recorder:
                out = layer(x, attention_mask=None, rotary_pos_emb=freqs)[0]
                scopes.close(out)
            # a layer inside the decoder: its output's gradient is the next layer's input
            # gradient (boost: a buffer its bda may accumulate into, parallel/residual.py)
            out = as_next_layer_input(out)
            grad = torch.empty_like(out)
            with recorder:
                out.backward(grad)
    by_scope: Dict[str, int] = {}
    for s in saved.storages.values():
        by_scope[s.label] = by_scope.get(s.label, 0) + s.nbytes
    return LayerLedger(spec=spec, kernels=recorder.kernels,
                       collectives=_collective_entries(recorder.kernels, log),
                       saved_bytes=saved.bytes, saved_by_scope=by_scope,
                       saved_fp32_wide=_fp32_wide(saved, x.shape[0] * spec.micro_batch))


_CACHE: Dict[LedgerSpec, LayerLedger] = {}
"""The ledgers measured in this process, by :func:`_layer_key`."""


def _layer_key(spec: LedgerSpec) -> LedgerSpec:
    """What one layer's ledger depends on: ``spec`` less the model's name, depth, tying and
    default sequence length (:func:`_run_config` builds one layer at ``spec.seq_length``), so
    models of one layer shape share a measurement."""
    shape = dataclasses.replace(spec.shape, name="", num_layers=1, tied_embeddings=False,
                                seq_length=spec.seq_length)
    return dataclasses.replace(spec, shape=shape)


def _measured_here(spec: LedgerSpec) -> LayerLedger:
    import warnings

    # megatron's notices on a CPU without TE or apex (one per import and layer) say nothing of
    # a ledger, and would bury what a tool that reads one prints (tools/perf_model.py)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron_boost.runtime.cpu_mode import cpu_mode_left_as_found, use_cpu

        with cpu_mode_left_as_found():
            use_cpu(force=True)
            return ledger_in_process(spec)


def _child(specs: List[LedgerSpec], queue) -> None:
    try:
        queue.put(("ok", [_measured_here(spec) for spec in specs]))
    except BaseException as err:  # reported to the parent, which raises it
        queue.put(("error", f"{type(err).__name__}: {err}"))


def _measured_in_child(specs: List[LedgerSpec], timeout: float = 600.0) -> List[LayerLedger]:
    """:func:`ledger_in_process` of each spec in one spawned process of its own, for a caller
    whose process already has a process group (a rank of the GPU check); the child ends
    before this returns."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_child, args=(specs, queue))
    proc.start()
    try:
        status, payload = queue.get(timeout=timeout)
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if status != "ok":
        raise RuntimeError(f"op ledger: {payload}")
    return payload


def measure_ledgers(specs: Sequence[LedgerSpec]) -> List[LayerLedger]:
    """The ledgers of ``specs``, each measured once per process: here
    (:func:`ledger_in_process`), or, when this process has a process group already, all the
    missing ones in one child process."""
    import torch.distributed as dist

    missing = list(dict.fromkeys(k for k in map(_layer_key, specs) if k not in _CACHE))
    if missing and dist.is_available() and dist.is_initialized():
        _CACHE.update(zip(missing, _measured_in_child(missing)))
    for key in missing:
        if key not in _CACHE:
            _CACHE[key] = _measured_here(key)
    return [dataclasses.replace(_CACHE[_layer_key(spec)], spec=spec) for spec in specs]


def layer_ledger(spec: LedgerSpec) -> LayerLedger:
    """The ledger of ``spec`` (:func:`measure_ledgers`)."""
    return measure_ledgers([spec])[0]


def ledger_table(ledgers: Sequence[Any]) -> str:
    """The ledgers side by side, one row per layer (the tool's and docs' table); each a
    :class:`LayerLedger` or its :meth:`LayerLedger.to_dict` (a JSON file's entry)."""
    gb, gib = 1e9, 2 ** 30
    lines = ["| layer | tp | kernels fwd+bwd (CPU eager) | GEMMs | GEMM TFLOP | "
             "elementwise+copy GB (fwd / bwd) | outside attention GB | layout copies "
             "outside attention | collectives (exposed: count, MiB) | saved GiB | "
             "fp32 [T, >1] saved GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for lg in ledgers:
        entry = lg.to_dict() if isinstance(lg, LayerLedger) else lg
        spec, s = entry["spec"], entry["summary"]
        lines.append(
            f"| {spec_label(spec)} | {spec['tp']} | {s['total']['kernels']} "
            f"({s['total']['eager_kernels']}) | {s['total']['gemm']['kernels']} | "
            f"{s['total']['gemm_flops'] / 1e12:.2f} | {s['total']['traffic_bytes'] / gb:.2f} "
            f"({s['fwd']['traffic_bytes'] / gb:.2f} / {s['bwd']['traffic_bytes'] / gb:.2f}) | "
            f"{s['traffic_bytes_outside_attention'] / gb:.2f} | "
            f"{s['layout_copies_outside_attention']} | {len(entry['collectives'])} "
            f"({s['collectives_exposed']}: {s['collectives_exposed_bytes'] / 2 ** 20:.0f}) | "
            f"{s['saved_bytes'] / gib:.2f} | "
            f"{s['saved_fp32_wide_bytes'] / gib:.2f} |")
    return "\n".join(lines)


def spec_label(spec: Any) -> str:
    """The layer's name in the tables: its mode, ``+sp`` with sequence parallelism, the
    pipelined all-reduce's chunks and the recompute where they are not the default. ``spec``:
    a :class:`LedgerSpec` or its dict (a JSON file's)."""
    get = (spec if isinstance(spec, dict) else spec.to_dict()).get
    label = check_mode(get("mode")).value + ("+sp" if get("sequence_parallel") else "")
    if get("overlap_chunks") > 1:
        label += f" ({get('overlap_chunks')} chunks)"
    if get("recompute"):
        label += f" ({get('recompute')} recompute)"
    if get("interleave_halves"):
        label += " (halves)"
    return label


def ledger_from_dict(entry: Dict[str, Any]) -> LayerLedger:
    """A ledger back from :meth:`LayerLedger.to_dict` (a JSON file's entry; its spec stays a
    dict, which :func:`spec_label` reads)."""
    def kernel(k):
        return Kernel(**{**k, "shapes": tuple(tuple(s) for s in k["shapes"]),
                         "deps": tuple(k.get("deps", ()))})

    collectives = [CollectiveEntry(**{f: c[f] for f in CollectiveEntry.__dataclass_fields__
                                      if f in c}) for c in entry["collectives"]]
    return LayerLedger(spec=entry["spec"], kernels=[kernel(k) for k in entry["kernels"]],
                       collectives=collectives, saved_bytes=entry["summary"]["saved_bytes"],
                       saved_by_scope=entry["saved_by_scope"],
                       saved_fp32_wide=entry["saved_fp32_wide"])


def ledger_json(ledgers: Sequence[LayerLedger]) -> str:
    return json.dumps([lg.to_dict() for lg in ledgers], indent=1, default=str)
