"""Tensor-parallel communication of one decoder layer, measured (the formula is
``analysis/comm.py``).

:func:`measure_layer_comm_specs` and :func:`layer_comm_worker` build ONE megatron-core
``TransformerLayer`` from :func:`megatron_boost.model.specs.get_layer_spec` (through
:func:`build_decoder_layer`, as the model builds its decoder), run it forward and backward under
:func:`megatron_boost.measure.collectives.record_collectives`, which reports what the TP group
really carried. Every activation collective of a layer is ``tokens × width`` elements, so bytes
per token measured at a small token count scale *exactly* (integer arithmetic) to any B·S.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.spec_utils import build_module

from megatron_boost.config.layout import Layout
from megatron_boost.config.modes import TPMode
from megatron_boost.config.placement import Tensor, tensor_local_shape
from megatron_boost.config.resolved import resolve_run, to_transformer_config
from megatron_boost.config.run import ModelConfig, RunConfig
from megatron_boost.measure.collectives import CommLog, record_collectives
from megatron_boost.model.specs import default_pg_collection, get_layer_spec, \
    replicated_decoder_pgs

__all__ = ["LayerCommSpec", "comm_summary", "measure_layer_comm", "measure_layer_comm_specs",
           "layer_comm_worker", "build_decoder_layer", "layer_input_shape"]


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
    layout: Layout = Layout(tp=2, sequence_parallel=False)
    """The mode, the TP size and (full mode) megatron's sequence parallelism (off: the
    per-layer formula's plain TP)."""
    seq_length: int = 16
    """Tokens per sequence of the measurement (small: bytes scale exactly with tokens)."""
    micro_batch_size: int = 1
    dtype: str = "fp32"
    seed: int = 1234


def _run_config(spec: LayerCommSpec):
    cfg = RunConfig()
    cfg.model = ModelConfig(**{**asdict(ModelConfig()), **spec.model})
    cfg.model.seq_length = spec.seq_length
    cfg.parallel.mode, cfg.parallel.tp = spec.layout.mode.value, spec.layout.tp
    cfg.parallel.sequence_parallel = bool(spec.layout.sequence_parallel)
    return cfg.validate()


def build_decoder_layer(config, pgs=None):
    """One megatron-core TransformerLayer of ``config.tp_mode`` (layer_number 1), built the way
    BottleneckGPTModel builds its decoder: naive layers get the one-rank decoder group for
    attention / MLP and the real TP group for their bottlenecks."""
    pgs = pgs or default_pg_collection()
    spec = get_layer_spec(config, pgs.tp)
    layer_pgs = replicated_decoder_pgs(pgs) if config.tp_mode is TPMode.NAIVE else pgs
    return build_module(spec, config=config, layer_number=1, pg_collection=layer_pgs)


def layer_input_shape(spec: LayerCommSpec, hidden_size: int) -> Tuple[int, int, int]:
    """The measured layer's input on one rank, [s, b, d] split along d where the placement
    table splits the stream (boost). The stream's sequence-parallel split is not applied: with
    sequence parallelism the measurement's s positions are each rank's sequence shard."""
    stream = (spec.seq_length, spec.micro_batch_size, hidden_size)
    return tensor_local_shape(spec.layout.mode, Tensor.STREAM, stream, spec.layout.tp)


def layer_comm_worker(rank: int, world: int, specs) -> Any:
    """In each of ``tp`` gloo processes: for each spec (one, or a list sharing one tp), build one
    decoder layer, run it forward and backward on [seq_length, micro_batch_size, width] random
    inputs and return the :func:`comm_summary` of its TP collectives (a dict, or a list of them).
    """
    single = isinstance(specs, LayerCommSpec)
    specs = [specs] if single else list(specs)
    if any(s.layout.tp != world for s in specs):
        raise ValueError(f"world size ({world}) must equal every spec's tp "
                         f"({[s.layout.tp for s in specs]})")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    results = measure_layer_comm_specs(rank, specs)
    return results[0] if single else results


def measure_layer_comm_specs(rank: int, specs: Sequence[LayerCommSpec]) -> List[Dict[str, Any]]:
    """:func:`layer_comm_worker`'s measurement, in a process whose megatron parallel state is
    already initialised with TP = every spec's tp."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    results = []
    for spec in specs:
        cfg = _run_config(spec)
        model_parallel_cuda_manual_seed(spec.seed)
        torch.manual_seed(spec.seed)
        run = resolve_run(cfg, vocab_size=cfg.model.vocab_size).with_precision(spec.dtype)
        dtype = run.params_dtype
        config = to_transformer_config(run)
        layer = build_decoder_layer(config)
        shape = layer_input_shape(spec, config.hidden_size)
        width = shape[-1]
        g = torch.Generator().manual_seed(spec.seed + rank)
        x = torch.randn(shape, generator=g).to(dtype)
        x.requires_grad_(True)
        log = measure_layer_comm(layer, x, tp_group)
        out = comm_summary(log, spec.seq_length * spec.micro_batch_size)
        out.update(mode=spec.layout.mode.value, input_width=width, element_size=x.element_size(),
                   n_params_local=sum(p.numel() for p in layer.parameters()))
        results.append(out)
        del layer, x, log
    return results
