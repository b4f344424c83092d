"""Layout-independent initialisation (docs/design.md §8); CoLA's init formula (§1) is the
layers' own (parallel/layers.py).

Every parameter is drawn as its GLOBAL tensor from a generator seeded by the run seed and the
parameter's global checkpoint key, then sliced to this rank's shard: the same seed gives the
same global weights in every mode that shares the key and in every TP/PP layout. Global keys,
shapes and slices come from the model's own ``sharded_state_dict`` (megatron's checkpoint
metadata), so they follow whatever the layout is.
"""

from __future__ import annotations

import functools
import math
import zlib
from typing import Callable, Iterable, List

import torch

from megatron_boost.model.gpt import GatheredRMSNorm
from megatron_boost.parallel.layers import BottleneckGroup, cola_std

__all__ = ["sharded_params", "uses_output_init", "starts_at_one",
           "init_global_weights", "build_globally_initialised"]


def sharded_params(model: torch.nn.Module, prefix: str = ""):
    """(global key, global shape, local slice of the global tensor -> local tensor, param) for
    every global tensor, from the model's sharded_state_dict (so global names and shapes follow
    megatron's own checkpoint metadata, whatever the layout). ``param`` is the parameter, or
    for a parameter holding several global tensors (a grouped A) its rows of it."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    by_ptr = {p.data_ptr(): p for p in model.parameters()}
    out = []
    for sh in nested_values(model.sharded_state_dict(prefix=prefix)):
        data = getattr(sh, "data", None)
        param = by_ptr.get(data.data_ptr()) if isinstance(data, torch.Tensor) else None
        if param is None:
            continue
        if isinstance(sh, ShardedTensorFactory):
            # megatron's gated fc1 (full mode) saves its local [gate_k; up_k] as two pieces of
            # the global [gate; up]: the local tensor is their concatenation along dim 0. A
            # grouped A (parallel/layers.py) holds several global tensors, A_q, A_k, ...: one
            # entry each, over its rows of the local tensor.
            pieces = [p for p in nested_values(sh.build()) if isinstance(p, ShardedTensor)]
        elif isinstance(sh, ShardedTensor):
            pieces = [sh]
        else:
            continue
        if len({piece.key for piece in pieces}) == 1:
            out.append((_identity(pieces[0]), _global_shape(pieces[0]), _slicer(pieces), param))
            continue
        row = 0
        for piece in pieces:
            rows = piece.local_shape[0]
            out.append((_identity(piece), _global_shape(piece), _slicer([piece]),
                        _rows_of(param, row, rows)))
            row += rows
    return out


def _identity(sh) -> str:
    """The global key of a ShardedTensor. Layers are stacked along prepended axes (the global
    layer index): they become part of the identity, "decoder.layers.mlp.linear_fc1.B_up@3"."""
    pre = sh.prepend_axis_num
    return sh.key if not pre else sh.key + "@" + ".".join(str(o) for o in sh.global_offset[:pre])


def _global_shape(sh) -> tuple:
    return tuple(sh.global_shape[sh.prepend_axis_num:])


def _rows_of(param: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Rows [start, start + rows) of a parameter, sharing its memory (writes reach it), with
    the same rows of its ``main_grad`` (megatron's DDP gradient buffer) where it has one."""
    view = param.detach().narrow(0, start, rows)
    if getattr(param, "main_grad", None) is not None:
        view.main_grad = param.main_grad.narrow(0, start, rows)
    return view


def _slicer(pieces):
    """global tensor -> this rank's local tensor (pieces concatenated along dim 0)."""
    def slice_(global_tensor):
        parts = []
        for sh in pieces:
            pre = sh.prepend_axis_num
            # global_offset includes the prepended (layer) axes; local_shape does not.
            idx = tuple(slice(o, o + n) for o, n in zip(sh.global_offset[pre:], sh.local_shape))
            parts.append(global_tensor[idx])
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return slice_


def _row_parallel_types() -> tuple:
    """megatron's row-parallel linear classes (the full-rank proj and fc2): the local one, and
    Transformer Engine's where it imports."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    from megatron_boost.runtime.backends import te_available

    if not te_available():
        return (RowParallelLinear,)
    from megatron.core.extensions.transformer_engine import TERowParallelLinear

    return RowParallelLinear, TERowParallelLinear


def uses_output_init(module: torch.nn.Module, param_name: str) -> bool:
    """Whether a parameter is drawn with megatron's scaled output init (scaled_init_method_
    normal), decided by the type of the module that holds it, never by where it sits: every
    B factor of a bottleneck (the layers draw B with ``output_layer_init_method``), every
    factor of a group that writes the residual stream (proj, fc2: ``Group.writes_residual``
    of the placement table), and megatron's row-parallel linears (full rank proj, fc2)."""
    if isinstance(module, BottleneckGroup):
        return module.group.writes_residual or param_name.startswith("B_")
    return isinstance(module, _row_parallel_types())


@functools.lru_cache(maxsize=None)  # asked per parameter; what imports does not change
def _norm_types() -> tuple:
    """The normalisation modules: torch's (megatron's local spec builds them through
    WrappedTorchNorm), megatron's apex FusedLayerNorm, boost's final GatheredRMSNorm, and
    Transformer Engine's (what TENorm builds) where it imports."""
    from megatron.core.fusions.fused_layer_norm import FusedLayerNorm

    from megatron_boost.runtime.backends import te_available

    types = (torch.nn.RMSNorm, torch.nn.LayerNorm, FusedLayerNorm, GatheredRMSNorm)
    if not te_available():
        return types
    import transformer_engine.pytorch as te_pytorch

    return (*types, te_pytorch.RMSNorm, te_pytorch.LayerNorm)


@functools.lru_cache(maxsize=None)
def _norm_fusing_types() -> tuple:
    """The linears that fuse the norm before them and hold its scale as ``layer_norm_weight``:
    the bottleneck groups' column layers (online RMSNorm) and Transformer Engine's
    LayerNormColumnParallelLinear where it imports."""
    from megatron_boost.runtime.backends import te_available

    if not te_available():
        return (BottleneckGroup,)
    from megatron.core.extensions.transformer_engine import TELayerNormColumnParallelLinear

    return BottleneckGroup, TELayerNormColumnParallelLinear


def starts_at_one(module: torch.nn.Module, param_name: str) -> bool:
    """Whether a parameter is a norm's scale, which starts at one, decided by the type of the
    module that holds it, never by where it sits: every parameter of a normalisation module
    (RMSNorm, the only normalisation here, has its scale only) and the ``layer_norm_weight``
    of a linear that fuses its norm."""
    if isinstance(module, _norm_types()):
        return True
    return param_name == "layer_norm_weight" and isinstance(module, _norm_fusing_types())


def _holders(chunks: List[torch.nn.Module]) -> Callable[[torch.Tensor], torch.nn.Module]:
    """tensor -> the module holding the parameter whose memory it lies in (a grouped A's row
    views lie in the grouped A)."""
    spans = [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size(), m)
             for chunk in chunks for m in chunk.modules() for p in m.parameters(recurse=False)]

    def holder(t: torch.Tensor) -> torch.nn.Module:
        return next(m for lo, hi, m in spans if lo <= t.data_ptr() < hi)
    return holder


def _init_rule(key: str, shape, shapes_by_key, config, gen, output_init: bool,
               norm_scale: bool) -> torch.Tensor:
    """The global tensor of ``key``: ones for a norm's scale (``norm_scale``,
    :func:`starts_at_one`), CoLA's normal for bottleneck factors
    (with ``cola_init``), else megatron's normal(init_method_std), scaled by 1/sqrt(2L) where
    ``output_init`` (:func:`uses_output_init`; megatron's scaled_init_method_normal)."""
    base, at, layer = key.partition("@")
    name = base.rsplit(".", 1)[-1]
    if norm_scale:
        return torch.ones(shape)
    if name.startswith(("A_", "B_")) and config.cola_init:
        proj = name[2:]
        a_shape = shapes_by_key[f"{base[: -len(name)]}A_{proj}{at}{layer}"]  # [r, d_in]
        b_shape = shapes_by_key[f"{base[: -len(name)]}B_{proj}{at}{layer}"]  # [d_out, r]
        return torch.randn(shape, generator=gen) * cola_std(a_shape[0], a_shape[1], b_shape[0])
    std = config.init_method_std
    if output_init:
        std = std / math.sqrt(2.0 * config.num_layers)  # megatron's scaled output init
    return torch.randn(shape, generator=gen) * std


def init_global_weights(chunks: Iterable[torch.nn.Module], seed: int, config) -> None:
    """Initialise every parameter from ``seed`` and its global checkpoint key, so the global
    (unsharded) weights are identical for every mode that shares the key and every TP/PP
    layout. Each global tensor is drawn from its own generator and sliced."""
    chunks = list(chunks)
    entries = [e for chunk in chunks for e in sharded_params(chunk)]
    _check_every_parameter_covered(chunks, entries)
    shapes = {key: shape for key, shape, _, _ in entries}
    holder = _holders(chunks)
    with torch.no_grad():
        for key, shape, slicer, param in entries:
            gen = torch.Generator().manual_seed(seed ^ zlib.crc32(key.encode()))
            name = key.partition("@")[0].rsplit(".", 1)[-1]
            module = holder(param)
            full = _init_rule(key, shape, shapes, config, gen,
                              uses_output_init(module, name), starts_at_one(module, name))
            local = slicer(full)
            if local.shape != param.shape:
                raise RuntimeError(f"init of {key}: slice {tuple(local.shape)} of global "
                                   f"{tuple(shape)} does not match the parameter "
                                   f"{tuple(param.shape)}")
            param.copy_(local.to(param.dtype))


def _check_every_parameter_covered(chunks, entries) -> None:
    """Every element of every parameter must be written by the global init: a model built
    without megatron's own init (:func:`build_globally_initialised`) would otherwise keep
    uninitialised memory."""
    def span(t):  # the memory of a contiguous tensor: [first byte, last byte + 1)
        return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()

    written = [span(tensor) for *_, tensor in entries]

    def covered(p) -> int:
        lo, hi = span(p)
        return sum(max(0, min(b, hi) - max(a, lo)) for a, b in written)

    missing = [name for chunk in chunks for name, p in chunk.named_parameters()
               if covered(p) < p.numel() * p.element_size()]
    if missing:
        raise RuntimeError(f"init_global_weights: no global checkpoint key for parameter(s) "
                           f"{missing}; every parameter needs one in sharded_state_dict")


def build_globally_initialised(build: Callable[[], List[torch.nn.Module]], config,
                               seed: int) -> List[torch.nn.Module]:
    """``build()``'s model chunks with every weight drawn once: megatron's per-layer init
    (``perform_initialization``, and this project's layers and embedding, which follow it) is
    off while they are built, the TP attributes megatron sets only in its init are set from
    the checkpoint metadata, and :func:`init_global_weights` then writes every parameter (it
    checks that none is left out)."""
    saved = config.perform_initialization
    config.perform_initialization = False
    try:
        chunks = build()
    finally:
        config.perform_initialization = saved
    for chunk in chunks:
        _set_missing_tp_attributes(chunk)
    init_global_weights(chunks, seed, config)
    return chunks


def _set_missing_tp_attributes(model: torch.nn.Module) -> None:
    """megatron sets the TP attributes of its parallel layers' weights (``tensor_model_parallel``,
    ``partition_dim``, ``stride``) inside its init functions, so without
    ``perform_initialization`` they are missing, and the gradient norm would count those
    weights on TP rank 0 only (docs/design.md §10.8). They are set here from the checkpoint
    metadata instead: a parameter whose local shape differs from its global one along one
    axis is sharded along that axis."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for _, shape, _, param in sharded_params(model):
        if not isinstance(param, torch.nn.Parameter) or hasattr(param,
                                                                "tensor_model_parallel"):
            continue
        axes = [i for i, (n_local, n_global) in enumerate(zip(param.shape, shape))
                if n_local != n_global]
        if len(axes) == 1:
            set_tensor_model_parallel_attributes(param, True, axes[0], 1)
