"""Global weights for one bottleneck group, for the layer tests (tests/test_layers.py,
tests/test_placement.py): the global shape of every parameter, the axis it is sharded along,
this rank's tensor (or gradient) of a global parameter name, this rank's slice of a global
tensor, and loading a set of global tensors into the sharded parameters. The layers
themselves know only their grouped factors (``parallel/layers.py``)."""

from __future__ import annotations

from typing import Dict, Optional

import torch

from megatron_boost.parallel.layers import WeightFactor

__all__ = ["global_shapes", "axis_of", "local", "shard_of", "load_global_weights"]


def global_shapes(group) -> Dict[str, tuple]:
    """Global (unsharded) shape of every parameter of a ``BottleneckGroup``, by name."""
    shapes = {}
    for p in group.projections:
        shapes[f"A_{p.name}"] = (p.rank, group.input_size)
        shapes[f"B_{p.name}"] = (p.d_out, p.rank)
    if group.fuse_norm:
        shapes["layer_norm_weight"] = (group.input_size,)
    return shapes


def _factor_of(name: str) -> Optional[WeightFactor]:
    """The factor of a global parameter name A_<p> / B_<p>; None for layer_norm_weight."""
    return WeightFactor(name[0]) if name.startswith(("A_", "B_")) else None


def axis_of(group, name: str) -> int:
    """The axis along which a global parameter (A_<p>, B_<p>, layer_norm_weight) is sharded
    over the TP group: a factor's from the placement table, γ's as its TP attribute says."""
    factor = _factor_of(name)
    if factor is not None:
        return group.split_axis(factor)
    return getattr(group, name).partition_dim


def local(group, name: str, grad: bool = False) -> Optional[torch.Tensor]:
    """This rank's tensor of a global parameter name (A_<p>, B_<p>, layer_norm_weight), or its
    gradient: A_<p>, B_<p> are their rows of the grouped factor."""
    factor = _factor_of(name)
    if factor is None:
        param = getattr(group, name)
        return param.grad if grad else param
    grouped = getattr(group, factor.value)
    source = grouped.grad if grad else grouped
    if source is None:
        return None
    i = [f"{factor.value}_{p.name}" for p in group.projections].index(name)
    rows = [f.shape[0] for f in group.factors(factor)]  # each projection's rows
    return source.split(rows, dim=0)[i]


def shard_of(group, name: str, global_tensor: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the global parameter ``name`` (along its TP axis, :func:`axis_of`)."""
    return global_tensor.chunk(group.tp_size, dim=axis_of(group, name))[group.tp_rank]


def load_global_weights(group, weights: Dict[str, torch.Tensor]) -> None:
    """Copy this rank's slices of the given global tensors into the parameters."""
    with torch.no_grad():
        for name, tensor in weights.items():
            local(group, name).copy_(shard_of(group, name, tensor))
