"""A CPU stand-in for Transformer Engine's modules, for the checkpoint tests.

What matters here is TE's checkpoint contract, not its kernels. Every TE module has *extra
state* (its FP8 recipe state): ``get_extra_state`` returns a uint8 tensor, empty while there is
nothing to keep, else the state pickled into bytes; ``set_extra_state`` takes that tensor back
and ignores an empty one or ``None`` (TE 2.x, ``transformer_engine/pytorch/ops/op.py``,
``BasicOperation.get_extra_state`` / ``set_extra_state``, which TE's RMSNorm inherits;
``module/base.py``'s ``TransformerEngineBaseModule`` has the same contract). torch lists it
as ``<module>._extra_state`` in ``state_dict()`` and megatron saves it as a ShardedObject
(``make_sharded_tensors_for_checkpoint`` in ``megatron/core/transformer/utils.py``), except for
TE's core attention, whose ``sharded_state_dict`` returns nothing (``TEDotProductAttention`` in
``megatron/core/extensions/transformer_engine.py``).

:func:`te_standins` puts stand-ins in every slot the TE spec fills (model/specs.py): the norm
slots and core attention in naive (and its final norm, which get_block_spec takes from the norm
slot), core attention in boost, and in full, where megatron's TE layer replaces the whole layer,
the norms, core attention and the four linear slots. :func:`pretrain_main` is the trainer's
entry point with them installed, for the rank pool (tests/rank_pool.py ``target``).
"""

from __future__ import annotations

import contextlib
import pickle
from typing import Optional

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["TEExtraState", "te_standins", "pretrain_main", "standin_modules"]


class TEExtraState:
    """TE's extra-state contract. ``te_state`` stands for the FP8 recipe state (scales, amax
    history): None is TE without FP8 (an empty tensor is saved); each training forward
    counts one more, as an FP8 recipe updates its amax history every step."""

    te_state: Optional[dict] = None
    #: Whether megatron saves it (not for core attention, see :func:`_standin_attention`).
    checkpointed = True

    def get_extra_state(self) -> torch.Tensor:
        if self.te_state is None:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(bytearray(pickle.dumps(self.te_state)), dtype=torch.uint8)

    def set_extra_state(self, state: Optional[torch.Tensor]) -> None:
        if state is None or state.numel() == 0:
            return
        self.te_state = pickle.loads(state.detach().numpy(force=True).tobytes())

    def count_forward(self) -> None:
        if self.training:
            self.te_state = {"forwards": (self.te_state or {}).get("forwards", 0) + 1}


class StandInNorm(TEExtraState, torch.nn.RMSNorm):
    """TE's RMSNorm slot (``TENorm``): a plain torch module, no ``sharded_state_dict``, so
    megatron's ``sharded_state_dict_default`` saves its weight and extra state."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
        super().__init__(hidden_size, eps=eps)

    def forward(self, x):
        self.count_forward()
        return super().forward(x)


class StandInColumn(TEExtraState, ColumnParallelLinear):
    """TE's column-parallel linear slot (full mode)."""

    def forward(self, *args, **kwargs):
        self.count_forward()
        return super().forward(*args, **kwargs)


class StandInRow(TEExtraState, RowParallelLinear):
    """TE's row-parallel linear slot (full mode)."""

    def forward(self, *args, **kwargs):
        self.count_forward()
        return super().forward(*args, **kwargs)


def _standin_attention(cls):
    """TE's core attention on ``cls``: extra state in ``state_dict()``, nothing in the sharded
    state dict (megatron's TEDotProductAttention.sharded_state_dict without a learnable
    softmax offset)."""

    def forward(self, *args, **kwargs):
        self.count_forward()
        return cls.forward(self, *args, **kwargs)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        return {}

    return type(f"StandIn{cls.__name__}", (TEExtraState, cls),
                {"forward": forward, "sharded_state_dict": sharded_state_dict,
                 "checkpointed": False})


def _with_standins(spec, config):
    from megatron_boost.compat import spec_submodules
    from megatron_boost.config.modes import TPMode

    sub = spec.submodules
    attn, mlp = spec_submodules(sub.self_attention), spec_submodules(sub.mlp)
    attn.core_attention = _standin_attention(attn.core_attention)
    if config.tp_mode is not TPMode.BOOST:  # boost's norms are fused into its bottlenecks
        sub.input_layernorm = sub.pre_mlp_layernorm = StandInNorm
    if config.tp_mode is TPMode.FULL:
        attn.linear_qkv, mlp.linear_fc1 = StandInColumn, StandInColumn
        attn.linear_proj, mlp.linear_fc2 = StandInRow, StandInRow
    return spec


@contextlib.contextmanager
def te_standins():
    """Models built inside take the stand-ins in TE's slots (the layer spec the model module
    asks for is edited; naive's and full's final norm is the layer's norm slot)."""
    from megatron_boost.model import gpt

    original = gpt.get_layer_spec

    def get_layer_spec(config, tp_group):
        return _with_standins(original(config, tp_group), config)

    gpt.get_layer_spec = get_layer_spec
    try:
        yield
    finally:
        gpt.get_layer_spec = original


def standin_modules(model: torch.nn.Module) -> dict:
    """{qualified name: module} of the stand-ins in ``model``."""
    return {name: m for name, m in model.named_modules() if isinstance(m, TEExtraState)}


def pretrain_main(argv) -> int:
    """The trainer's ``main(argv)`` with the stand-ins installed (a rank pool target)."""
    from megatron_boost.cli.pretrain import main

    with te_standins():
        return main(argv)
