"""Rules of the validation pass (``config/validation.py``) for values that would be accepted and
then do nothing, or do harm without a word: a non-finite number, an optimizer's settings set
for another optimizer, more overlap chunks than the sequence has positions, CUDA graphs that a
replay would run wrong or that fail only at their capture. Each raises ``ValueError`` naming the key, its value, the rule and the fix.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Tuple

__all__ = ["check_finite_numbers", "check_muon_keys_need_muon", "check_overlap_chunks_fit",
           "check_cuda_graphs", "MUON_KEYS", "CUDA_GRAPH_IMPLS", "CUDA_GRAPH_SCOPES",
           "TE_GRAPHS_FIX"]

#: training.cuda_graph_impl values: megatron-core's own per-layer graphs (its full_iteration
#: graph wraps megatron-LM's training loop, which the trainer does not run).
CUDA_GRAPH_IMPLS = ("none", "local")
#: Why megatron's third value, transformer_engine, is not offered: megatron-core leaves those
#: graphs to the training script (its TECudaGraphHelper, driven by megatron-LM's loop), so
#: under this trainer the layers would run eagerly without a word.
TE_GRAPHS_FIX = ("transformer_engine's graphs are captured by megatron-LM's training loop "
                 "(TECudaGraphHelper), which this trainer does not run; use local")
#: training.cuda_graph_scope values of a dense decoder layer (megatron's moe and mamba scopes
#: have no layer here to capture).
CUDA_GRAPH_SCOPES = ("full", "attn", "mlp")

#: The optimizer section's keys that only Muon reads (train/muon.py).
MUON_KEYS = ("muon_momentum", "muon_nesterov", "muon_ns_steps", "muon_ns_coefficients",
             "muon_scale", "muon_extra_scale")


def _float_values(section, prefix: str) -> Iterator[Tuple[str, float]]:
    """(dotted key, value) of every float value of a config dataclass, nested sections
    (logging.wandb) included."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            yield from _float_values(value, f"{prefix}{f.name}.")
        elif isinstance(value, float):
            yield f"{prefix}{f.name}", value


def check_finite_numbers(cfg) -> None:
    """Every number of the config is finite: a nan or inf (``model.norm_epsilon=nan``) passes
    every comparison-based rule that is not written against it, and the run then skips every
    step or trains nothing with exit status 0."""
    for dotted, value in _float_values(cfg, ""):
        if not math.isfinite(value):
            raise ValueError(f"{dotted} ({value}) must be a finite number; nan and inf are "
                             f"refused for every key (null where the key allows it means "
                             f"'not set')")


def check_muon_keys_need_muon(cfg) -> None:
    """Muon's settings changed from their defaults with another optimizer would be ignored
    without a word (as the WSD keys without WSD would be, which are refused too)."""
    o = cfg.optimizer
    if o.name == "muon":
        return
    defaults = type(o)()
    for key in MUON_KEYS:
        value = getattr(o, key)
        if value != getattr(defaults, key):
            raise ValueError(f"optimizer.{key} ({value!r}) is only used with optimizer.name: "
                             f"muon (it is {o.name!r}); remove it or set optimizer.name=muon")


def check_overlap_chunks_fit(cfg) -> None:
    """boost's overlap chunks split the sequence positions a layer sees (parallel/pipeline.py
    ``row_blocks``): more chunks than positions would leave the extra ones empty, so fewer
    all-reduces run than asked. A layer sees all ``model.seq_length`` positions in every
    layout: with pp > 1 boost ships a stage's [s, b, d/t] output as an [s/t, b, d] buffer
    (the schedule's seq_length is s/t, model/gpt.py), but views it back as [s, b, d/t] before
    the layers (``p2p_to_stream``), so s, not s/t, is the bound."""
    chunks, seq = cfg.parallel.bottleneck_overlap_chunks, cfg.model.seq_length
    if chunks > seq:
        raise ValueError(f"parallel.bottleneck_overlap_chunks ({chunks}) exceeds the "
                         f"{seq} sequence positions a layer sees (model.seq_length); each "
                         f"chunk needs at least one position, so set it to at most {seq}")


def check_cuda_graphs(impl: str, recompute, device: str) -> None:
    """Per-layer CUDA graphs replay the kernels captured once, so a layer's forward must read
    no Python state that changes between calls. Low-rank recompute's log of the forward
    all-reduces (parallel/recompute.py) is such state; megatron's full recompute needs its
    full-iteration graph (its TransformerConfig asserts so). Graphs capture CUDA streams:
    on the CPU megatron would fail only when the first layer is captured. ``device``: 'cuda',
    'cpu' or 'auto' (not known yet: checked again once resolved)."""
    if impl == "none":
        return
    if recompute in ("lowrank", "full"):
        raise ValueError(
            f"training.cuda_graph_impl ({impl!r}) cannot run with training.recompute "
            f"({recompute!r}): a graph replays the captured kernels, and "
            + ("low-rank recompute's log of the forward all-reduces is Python state a replay "
               "would freeze" if recompute == "lowrank" else
               "megatron's full recompute needs its full-iteration graph")
            + "; set training.recompute=null (or selective) or training.cuda_graph_impl=none")
    if device == "cpu":
        raise ValueError(
            f"training.cuda_graph_impl ({impl!r}) needs a CUDA device (this run is on cpu): "
            f"megatron captures CUDA graphs on CUDA streams; set training.cuda_graph_impl=none")
