"""Performance accounting: TP communication per layer, saved activations, analytic FLOPs.

Three independent instruments, used by ``tools/comm_volume.py``, ``tools/benchmark.py`` and the
tests:

* **TP communication** (:func:`layer_comm_formula`, :func:`measure_layer_comm`,
  :func:`layer_comm_worker`). The formula is DESIGN.md's per-layer table, written for any shape
  (GQA, kv_channels, separate attention / MLP ranks); the measurement runs ONE megatron-core
  ``TransformerLayer`` built from :func:`megatron_boost.model.gpt.get_layer_spec` forward and backward
  under :func:`megatron_boost.parallel.mappings.record_collectives` and reports what the TP group really
  carried. Every activation collective of a layer is ``tokens × width`` elements, so bytes per
  token measured at a small token count scale *exactly* (integer arithmetic) to any B·S.

* **Saved activations** (:class:`SavedActivations`): bytes of the tensors autograd saves for
  backward during a forward pass, through ``torch.autograd.graph.saved_tensors_hooks``. Unique
  storages are counted once, by their whole storage size (a saved view keeps its whole storage
  alive); storages that belong to parameters (or any tensor passed in ``exclude``) are left out.
  Only tensors packed outside a backward pass are counted, so the re-forward of activation
  recompute (which runs inside backward) is not.

* **FLOPs** (:func:`forward_flops_per_token`, :func:`step_flops`, :func:`rank_step_flops`,
  :func:`count_flops`). Model FLOPs come from :mod:`megatron_boost.analysis.flops` (matmuls only; a
  bottleneck projection costs 2·r·(d_in + d_out) per token, a dense one 2·d_in·d_out, the
  attention core 2·2·s·h·e, the LM head 2·d·V; training = 3 × forward). :func:`rank_step_flops`
  is what one TP rank *executes*: every GEMM split t ways, except in naive mode, whose attention
  core runs on the full heads on every rank (duplicated). :func:`count_flops` counts the same
  thing with ``torch.utils.flop_counter.FlopCounterMode`` for cross-checks.

Units: bytes are bytes; :func:`gib` = 2**30 bytes. The BOOST authors' "GB" figures for one
CoLA-7B layer are GiB (DESIGN.md section 2; see ``tools/comm_volume.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Sequence

import torch

from megatron_boost.analysis.collectives import CommLog, record_collectives

__all__ = [
    "MODES", "GIB", "gib", "layer_shape", "layer_comm_formula", "LayerCommSpec",
    "measure_layer_comm", "measure_layer_comm_specs", "layer_comm_worker", "comm_summary",
    "build_decoder_layer", "comm_volume_report", "PUBLISHED_7B_FWD",
    "SavedActivations", "forward_flops_per_token", "step_flops", "rank_step_flops",
    "count_flops",
]

MODES = ("full", "naive", "boost")
GIB = 2 ** 30
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def gib(nbytes: float) -> float:
    return nbytes / GIB


# ---------------------------------------------------------------------------------------------
# TP communication: formula
# ---------------------------------------------------------------------------------------------


def _model_section(cfg: Any) -> Any:
    """A RunConfig's model section, or the object itself (ModelConfig / TransformerConfig)."""
    return cfg.model if hasattr(cfg, "model") and hasattr(cfg, "parallel") else cfg


def layer_shape(cfg: Any) -> Dict[str, int]:
    """d, f, h, g, e, r_attn, r_mlp of a RunConfig / ModelConfig / BoostTransformerConfig."""
    m = _model_section(cfg)
    d = int(m.hidden_size)
    h = int(m.num_attention_heads)
    g = int(getattr(m, "num_query_groups", None) or h)
    e = int(getattr(m, "kv_channels", None) or d // h)
    if hasattr(m, "resolved_ranks"):
        ra, rm = m.resolved_ranks()
    else:
        ra, rm = getattr(m, "attn_rank", None), getattr(m, "mlp_rank", None)
    return {"d": d, "f": int(m.ffn_hidden_size), "h": h, "g": g, "e": e,
            "r_attn": None if ra is None else int(ra), "r_mlp": None if rm is None else int(rm)}


def layer_comm_formula(cfg: Any, mode: str) -> Dict[str, Any]:
    """Per-decoder-layer TP collectives, elements per token (DESIGN.md section 2 table).

    Returns fwd/bwd element widths per token, collective counts and the symbolic formula.
    MHA reduces to full 2d / 2d, naive 5d + 2f / 3d + f, boost 7r + 2 / 7r.

    * full: row-parallel proj and fc2 all-reduce their d-wide outputs forward; column-parallel
      qkv and fc1 all-reduce their d-wide input gradients backward.
    * naive: each chunk all-reduces its output forward (qkv: h·e + 2·g·e, o: d, gate+up: 2f,
      down: d) and its input gradient backward (qkv: d, o: h·e, fc1: d, fc2: f).
    * boost: one all-reduce of the group's bottleneck forward (qkv: 3r_a + 1 with the fused
      online-RMSNorm sum of squares, o: r_a, gate+up: 2r_m + 1, down: r_m) and of its gradient
      backward (the same without the +1).
    """
    s = layer_shape(cfg)
    d, f, h, g, e, ra, rm = (s[k] for k in ("d", "f", "h", "g", "e", "r_attn", "r_mlp"))
    if mode == "full":
        fwd, bwd = [d, d], [d, d]
        text = ("2d", "2d")
    elif mode == "naive":
        fwd, bwd = [h * e + 2 * g * e, d, 2 * f, d], [d, h * e, d, f]
        text = ("5d + 2f", "3d + f") if (h == g and h * e == d) else (
            "(h+2g)e + 2d + 2f", "2d + he + f")
    elif mode == "boost":
        if ra is None or rm is None:
            raise ValueError("boost mode needs attn_rank and mlp_rank")
        fwd, bwd = [3 * ra + 1, ra, 2 * rm + 1, rm], [3 * ra, ra, 2 * rm, rm]
        text = ("7r + 2", "7r") if ra == rm else ("4r_a + 3r_m + 2", "4r_a + 3r_m")
    else:
        raise ValueError(f"mode ({mode!r}) must be one of {MODES}")
    return {"fwd_elems_per_token": sum(fwd), "bwd_elems_per_token": sum(bwd),
            "fwd_count": len(fwd), "bwd_count": len(bwd),
            "fwd_widths": fwd, "bwd_widths": bwd,
            "fwd_formula": text[0], "bwd_formula": text[1]}


# ---------------------------------------------------------------------------------------------
# TP communication: measurement of one decoder layer
# ---------------------------------------------------------------------------------------------


def comm_summary(log: CommLog, tokens: int) -> Dict[str, Any]:
    """Per-direction bytes, elements, counts and widths of a log, plus bytes per token.

    Raises if a direction's bytes are not an exact multiple of ``tokens`` (then the records
    are not all per-token activation collectives and cannot be scaled linearly)."""
    out: Dict[str, Any] = {"tokens": tokens}
    for direction in ("fwd", "bwd"):
        recs = log.select(direction)
        nbytes = sum(r.nbytes for r in recs)
        numel = sum(r.numel for r in recs)
        if nbytes % tokens or numel % tokens:
            raise ValueError(f"{direction} collectives ({nbytes} B, {numel} elements) are not a "
                             f"multiple of the token count {tokens}")
        out[direction] = {
            "count": len(recs), "bytes": nbytes, "elems": numel,
            "bytes_per_token": nbytes // tokens, "elems_per_token": numel // tokens,
            "widths": [r.width for r in recs], "kinds": sorted({r.kind for r in recs}),
        }
    return out


def measure_layer_comm(layer: torch.nn.Module, x: torch.Tensor, group) -> CommLog:
    """Run ``layer`` forward and backward on ``x`` ([s, b, width]) while recording ``group``."""
    with record_collectives(group) as log:
        out = layer(x, attention_mask=None)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
    return log


@dataclass
class LayerCommSpec:
    """One per-layer measurement (plain data: picklable for spawned workers)."""

    model: Dict[str, Any] = field(default_factory=dict)
    """ModelConfig fields (hidden_size, ffn_hidden_size, heads, ranks, ...)."""
    mode: str = "boost"
    tp: int = 2
    seq_length: int = 16
    """Tokens per sequence of the measurement (small: bytes scale exactly with tokens)."""
    micro_batch_size: int = 1
    dtype: str = "fp32"
    seed: int = 1234


def _run_config(spec: LayerCommSpec):
    from megatron_boost.config.run import ModelConfig, RunConfig

    cfg = RunConfig()
    cfg.model = ModelConfig(**{**asdict(ModelConfig()), **spec.model})
    cfg.model.seq_length = spec.seq_length
    cfg.parallel.mode, cfg.parallel.tp = spec.mode, spec.tp
    return cfg.validate()


def build_decoder_layer(config, pgs=None):
    """One megatron-core TransformerLayer of ``config.tp_mode`` (layer_number 1), built the way
    BottleneckGPTModel builds its decoder: naive layers get the one-rank decoder group for
    attention / MLP and the real TP group for their bottlenecks."""
    from megatron.core.transformer.spec_utils import build_module

    from megatron_boost.config.transformer import TPMode
    from megatron_boost.model.specs import _replicated_decoder_pgs, default_pg_collection, \
        get_layer_spec

    pgs = pgs or default_pg_collection()
    spec = get_layer_spec(config, pgs.tp)
    layer_pgs = _replicated_decoder_pgs(pgs) if config.tp_mode is TPMode.NAIVE else pgs
    return build_module(spec, config=config, layer_number=1, pg_collection=layer_pgs)


def layer_comm_worker(rank: int, world: int, specs) -> Any:
    """In each of ``tp`` gloo processes: for each spec (one, or a list sharing one tp), build one
    decoder layer, run it forward and backward on [seq_length, micro_batch_size, width] random
    inputs and return the :func:`comm_summary` of its TP collectives (a dict, or a list of them).
    """
    from megatron.core import parallel_state

    single = isinstance(specs, LayerCommSpec)
    specs = [specs] if single else list(specs)
    if any(s.tp != world for s in specs):
        raise ValueError(f"world size ({world}) must equal every spec's tp "
                         f"({[s.tp for s in specs]})")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    results = measure_layer_comm_specs(rank, specs)
    return results[0] if single else results


def measure_layer_comm_specs(rank: int, specs: Sequence[LayerCommSpec]) -> List[Dict[str, Any]]:
    """:func:`layer_comm_worker`'s measurement, in a process whose megatron parallel state is
    already initialised with TP = every spec's tp."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_boost.config.run import to_transformer_config
    from megatron_boost.config.transformer import TPMode

    tp_group = parallel_state.get_tensor_model_parallel_group()
    results = []
    for spec in specs:
        cfg = _run_config(spec)
        dtype = DTYPES[spec.dtype]
        model_parallel_cuda_manual_seed(spec.seed)
        torch.manual_seed(spec.seed)
        config = to_transformer_config(cfg, params_dtype=dtype)
        layer = build_decoder_layer(config)
        d = config.hidden_size
        width = d // spec.tp if config.tp_mode is TPMode.BOOST else d
        g = torch.Generator().manual_seed(spec.seed + rank)
        x = torch.randn(spec.seq_length, spec.micro_batch_size, width, generator=g).to(dtype)
        x.requires_grad_(True)
        log = measure_layer_comm(layer, x, tp_group)
        out = comm_summary(log, spec.seq_length * spec.micro_batch_size)
        out.update(mode=spec.mode, input_width=width, element_size=x.element_size(),
                   n_params_local=sum(p.numel() for p in layer.parameters()))
        results.append(out)
        del layer, x, log
    return results


#: The BOOST authors' per-layer forward TP communication of LLaMA-7B (d 4096, f 11008, r 1024,
#: MHA), micro-batch 4, seq 4096, bf16, one layer, in their README's "GB" (which are GiB: see
#: :func:`comm_volume_report`).
PUBLISHED_7B_FWD = {"full": 0.25, "naive": 1.32, "boost": 0.22}
PUBLISHED_7B_SETTING = {"d": 4096, "f": 11008, "h": 32, "g": 32, "r_attn": 1024,
                        "r_mlp": 1024, "micro_batch_size": 4, "seq_length": 4096,
                        "dtype": "bf16"}


def comm_volume_report(cfg: Any, micro_batch_size: int, seq_length: int, tp: int,
                       dtype: str = "bf16", measured: Optional[Dict[str, Dict]] = None,
                       modes: Sequence[str] = MODES) -> Dict[str, Any]:
    """Per-layer TP communication of one micro-batch (B·S tokens) for each mode.

    ``measured``: per mode, a :func:`layer_comm_worker` result (bytes per token measured at a
    small token count); its bytes are scaled exactly: bytes_per_token · B · S. Without it only
    the formula is reported. The published 7B anchor is attached when the shape, batch and
    dtype are the authors' (see PUBLISHED_7B_SETTING)."""
    tokens = micro_batch_size * seq_length
    esize = DTYPE_BYTES[dtype]
    shape = layer_shape(cfg)
    setting = {**shape, "micro_batch_size": micro_batch_size, "seq_length": seq_length,
               "dtype": dtype}
    anchor = all(setting.get(k) == v for k, v in PUBLISHED_7B_SETTING.items())
    report: Dict[str, Any] = {"setting": {**setting, "tp": tp, "tokens": tokens,
                                          "element_size": esize},
                              "modes": {}}
    for mode in modes:
        f = layer_comm_formula(cfg, mode)
        entry: Dict[str, Any] = {"formula": {
            "fwd": f["fwd_formula"], "bwd": f["bwd_formula"],
            "fwd_elems_per_token": f["fwd_elems_per_token"],
            "bwd_elems_per_token": f["bwd_elems_per_token"],
            "fwd_bytes": f["fwd_elems_per_token"] * tokens * esize,
            "bwd_bytes": f["bwd_elems_per_token"] * tokens * esize,
            "fwd_count": f["fwd_count"], "bwd_count": f["bwd_count"],
            "fwd_widths": f["fwd_widths"], "bwd_widths": f["bwd_widths"]}}
        if measured is not None and mode in measured:
            m = measured[mode]
            entry["measured"] = {
                "measure_tokens": m["tokens"], "element_size": m["element_size"],
                "fwd_bytes_per_token": m["fwd"]["bytes_per_token"],
                "bwd_bytes_per_token": m["bwd"]["bytes_per_token"],
                "fwd_bytes": m["fwd"]["bytes_per_token"] * tokens,
                "bwd_bytes": m["bwd"]["bytes_per_token"] * tokens,
                "fwd_count": m["fwd"]["count"], "bwd_count": m["bwd"]["count"],
                "fwd_widths": m["fwd"]["widths"], "bwd_widths": m["bwd"]["widths"]}
            entry["match"] = all(entry["measured"][k] == entry["formula"][k] for k in (
                "fwd_bytes", "bwd_bytes", "fwd_count", "bwd_count"))
        if anchor:
            pub = PUBLISHED_7B_FWD[mode]
            fwd = entry["formula"]["fwd_bytes"]
            entry["published_fwd"] = {
                "value": pub, "ours_gib": fwd / GIB, "ours_gb": fwd / 1e9,
                "rel_diff_gib": fwd / GIB / pub - 1.0, "rel_diff_gb": fwd / 1e9 / pub - 1.0}
        report["modes"][mode] = entry
    return report


# ---------------------------------------------------------------------------------------------
# saved activations
# ---------------------------------------------------------------------------------------------


class SavedActivations:
    """Bytes autograd saves for backward while the context is active (forward passes).

    Usage::

        with SavedActivations(exclude=model.parameters()) as acc:
            loss = model(batch)           # one micro-batch forward, grad enabled
        acc.bytes, acc.count

    Every saved tensor is keyed by its storage (data pointer); a storage is counted once, at its
    full size. Storages of the tensors in ``exclude`` (parameters: their data, and any view of
    them such as ``weight.t()``) are not counted. Tensors packed while a backward pass runs
    (recompute re-forwards) are not counted. The pack hook returns the tensor itself, so the
    forward's memory behaviour is unchanged; the counted tensors all stay alive until their
    backward (or until the graph is dropped), so no storage address is reused while counting
    a single forward. Count one forward per context: across forward/backward pairs freed
    addresses can be reused and would be counted once.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {self._key(t) for t in exclude}
        self._seen: Dict[int, int] = {}
        self.packed = 0
        self.excluded_hits = 0
        self._ctx = None

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    def _pack(self, t: torch.Tensor):
        if torch._C._current_graph_task_id() == -1:  # not inside a backward pass
            self.packed += 1
            try:
                key = self._key(t)
                nbytes = t.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):  # e.g. a tensor without storage
                key, nbytes = id(t), t.numel() * t.element_size()
            if key in self._excluded:
                self.excluded_hits += 1
            elif key not in self._seen:
                self._seen[key] = nbytes
        return t

    @staticmethod
    def _unpack(t):
        return t

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())

    @property
    def count(self) -> int:
        return len(self._seen)

    def __enter__(self) -> "SavedActivations":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        return False


# ---------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------

try:  # the project's model-FLOPs formulas (megatron_boost/analysis/flops.py)
    from megatron_boost.analysis.flops import forward_flops_per_token as _flops_fwd_per_token
except ImportError:  # pragma: no cover - flops.py is part of the package
    _flops_fwd_per_token = None


def forward_flops_per_token(cfg: Any, mode: str, vocab_size: int, seq_length: int) -> float:
    """Forward matmul (model) FLOPs per token of the whole model (no duplication counted).

    Delegates to :func:`megatron_boost.analysis.flops.forward_flops_per_token` when available."""
    if _flops_fwd_per_token is not None:
        return float(_flops_fwd_per_token(cfg, mode, vocab_size=vocab_size,
                                          seq_length=seq_length))
    parts = _flop_parts(cfg, mode, vocab_size, seq_length)
    return parts["layers"] * (parts["proj"] + parts["core"]) + parts["head"]


def _flop_parts(cfg: Any, mode: str, vocab_size: int, seq_length: int) -> Dict[str, float]:
    """Per-token forward FLOPs: per-layer projections, per-layer attention core, LM head."""
    s = layer_shape(cfg)
    d, f, h, g, e = (s[k] for k in ("d", "f", "h", "g", "e"))
    ra, rm = (None, None) if mode == "full" else (s["r_attn"], s["r_mlp"])

    def proj(d_in, d_out, r):
        return 2.0 * d_in * d_out if r is None else 2.0 * r * (d_in + d_out)

    attn = proj(d, h * e, ra) + 2 * proj(d, g * e, ra) + proj(h * e, d, ra)
    mlp = 2 * proj(d, f, rm) + proj(f, d, rm)
    return {"layers": int(_model_section(cfg).num_layers), "proj": attn + mlp,
            "core": 4.0 * seq_length * h * e, "head": 2.0 * d * vocab_size}


def step_flops(cfg: Any, mode: str, tokens: int, vocab_size: int, seq_length: int) -> float:
    """Training (forward + backward = 3 × forward) model FLOPs of ``tokens`` tokens."""
    return 3.0 * tokens * forward_flops_per_token(cfg, mode, vocab_size, seq_length)


def rank_step_flops(cfg: Any, mode: str, tokens: int, vocab_size: int, seq_length: int,
                    tp: int) -> float:
    """Training matmul FLOPs one TP rank executes for ``tokens`` tokens (per pipeline stage
    summed over stages, i.e. the whole model divided only by TP).

    full / boost: everything split t ways. naive: projections and the vocab-parallel head split
    t ways, the attention core duplicated on every rank (it runs on the replicated heads).
    Recompute is not counted."""
    p = _flop_parts(cfg, mode, vocab_size, seq_length)
    core = p["layers"] * p["core"]
    split = p["layers"] * p["proj"] + p["head"]
    per_token = split / tp + (core if mode == "naive" else core / tp)
    return 3.0 * tokens * per_token


def count_flops(fn, *args, **kwargs):
    """(result of fn, total FLOPs counted by FlopCounterMode: mm/bmm/addmm/baddbmm/sdpa...)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        result = fn(*args, **kwargs)
    return result, int(counter.get_total_flops())
