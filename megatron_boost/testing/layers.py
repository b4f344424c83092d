"""Global weights for one bottleneck group, for the layer tests (tests/test_layers.py): the
global shape of every parameter, this rank's slice of a global tensor, and loading a set of
global tensors into the sharded parameters."""

from __future__ import annotations

from typing import Dict

import torch

__all__ = ["global_shapes", "shard_of", "load_global_weights"]


def global_shapes(group) -> Dict[str, tuple]:
    """Global (unsharded) shape of every parameter of a ``BottleneckGroup``, by name."""
    shapes = {}
    for p in group.projections:
        shapes[f"A_{p.name}"] = (p.rank, group.input_size)
        shapes[f"B_{p.name}"] = (p.d_out, p.rank)
    if group.fuse_norm:
        shapes["layer_norm_weight"] = (group.input_size,)
    return shapes


def shard_of(group, name: str, global_tensor: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the global parameter ``name`` (along its TP axis, ``axis_of``)."""
    return global_tensor.chunk(group.tp_size, dim=group.axis_of(name))[group.tp_rank]


def load_global_weights(group, weights: Dict[str, torch.Tensor]) -> None:
    """Copy this rank's slices of the given global tensors into the parameters."""
    with torch.no_grad():
        for name, tensor in weights.items():
            group.local(name).copy_(shard_of(group, name, tensor))
