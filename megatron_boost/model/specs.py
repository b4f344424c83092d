"""megatron-core layer specs of the three TP modes (docs/design.md §2) and the one-rank
decoder group of the naive mode.

* full:  megatron-core's local spec (RMSNorm, SwiGLU, RoPE, no biases): the full-rank baseline.
* naive: the naive bottleneck linears in the four linear slots. Attention, the MLP activation
         and the norms run on the replicated stream, duplicated on every TP rank, so the
         decoder is built with a one-rank "TP" group (:func:`replicated_decoder_pgs`) and the
         bottlenecks receive the real TP group from the spec.
* boost: BoostLinearQKV / BoostLinearFC1 (fused online-RMSNorm, docs/design.md §3) and
         BoostLinearProj / BoostLinearFC2; ResidualTap (an IdentityOp) for input_layernorm /
         pre_mlp_layernorm and residual_bias_dropout_add for the bda slots: the residual's
         gradient added in the A side's dgrad GEMM (parallel/residual.py).

In both bottleneck modes the attention and the MLP are ``BottleneckSelfAttention`` and
``BottleneckMLP`` (``model/blocks.py``), which take q, k, v and gate, up as the groups return
them.

Core attention in every mode is ``config.attention_backend`` (model/attention.py: SDPAttention,
megatron's DotProductAttention or TE's TEDotProductAttention). With ``te`` the full-rank model is
megatron's own TE layer (``get_gpt_layer_with_transformer_engine_spec``), naive also takes TE's
RMSNorm for its norm slots, and boost TE's attention only.

Both bottleneck modes use :class:`BottleneckTransformerLayer`, megatron's layer with optional
low-rank activation checkpointing (docs/design.md §7).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_boost.compat import (custom_mlp_slot, local_layer_spec, spec_submodules,
                                   te_layer_spec, with_module_class)
from megatron_boost.config.modes import TPMode
from megatron_boost.config.transformer import BoostTransformerConfig
from megatron_boost.model.attention import core_attention_class
from megatron_boost.model.blocks import BottleneckMLP, BottleneckSelfAttention
from megatron_boost.parallel.layers import (
    BoostLinearFC1,
    BoostLinearFC2,
    BoostLinearProj,
    BoostLinearQKV,
    NaiveLinearFC1,
    NaiveLinearFC2,
    NaiveLinearProj,
    NaiveLinearQKV,
)
from megatron_boost.parallel.interleave import join_halves, run_halves
from megatron_boost.parallel.recompute import lowrank_checkpoint
from megatron_boost.parallel.residual import ResidualTap, residual_bias_dropout_add

__all__ = ["get_layer_spec", "BottleneckTransformerLayer", "default_pg_collection", "te_norm",
           "replicated_decoder_pgs"]

def _own_rank_group():
    """A new process group holding only this rank, for one model build. With
    ``use_local_synchronization`` only the group's members take part in its creation, so each
    rank makes one call for its own group instead of every rank creating all world-size
    one-rank groups (O(world) collective calls). Made per build, from the default group of the
    moment, so a build never holds a group that a shutdown destroyed."""
    return dist.new_group([dist.get_rank()], use_local_synchronization=True)


def default_pg_collection() -> ProcessGroupCollection:
    """megatron-core's process groups (parallel_state must be initialised)."""
    return ProcessGroupCollection.use_mpu_process_groups()


def replicated_decoder_pgs(pgs: ProcessGroupCollection) -> ProcessGroupCollection:
    """The naive decoder's groups: TP replaced by a one-rank group (attention, MLP activation
    and norms run on the full, replicated tensors)."""
    out = copy.copy(pgs)
    # Only TP itself: megatron's decoder layers read tp, cp and pp, and otherwise only the
    # groups of features these models do not use (experts; 0.19's weight rematerialisation;
    # ``tp_cp`` in MoE routers and CUDA graphs), 0.16 to 0.19 alike.
    out.tp = _own_rank_group()
    return out


class BottleneckTransformerLayer(TransformerLayer):
    """megatron's TransformerLayer with optional low-rank activation checkpointing
    (``config.lowrank_recompute``) and optional interleaved halves of the micro-batch
    (``config.interleave_halves``); otherwise unchanged."""

    def forward(self, *args, **kwargs):
        if args:
            hidden, args = args[0], args[1:]
        else:
            hidden = kwargs.pop("hidden_states")
        training = self.training and torch.is_grad_enabled()
        if training and self.config.interleave_halves and hidden.shape[1] % 2 == 0:
            return self._forward_halves(hidden, args, kwargs)
        return self._forward_whole(hidden, args, kwargs)

    def _forward_whole(self, hidden, args, kwargs):
        """megatron's forward, checkpointed by low-rank recompute when that is on."""
        if not (self.config.lowrank_recompute and self.training and torch.is_grad_enabled()):
            return super().forward(hidden, *args, **kwargs)

        def run(h):
            return super(BottleneckTransformerLayer, self).forward(h, *args, **kwargs)[0]

        return lowrank_checkpoint(run, hidden), None

    def _forward_halves(self, hidden, args, kwargs):
        """The forward on each half of the batch, interleaved at boost's forward all-reduces
        (``parallel/interleave.py``); causal attention mixes no sequences, so the halves'
        outputs side by side are the whole batch's. Each half copies its own rows in inside its
        turn, so that half 1's copy runs beside half 0's first all-reduce."""
        views = hidden.chunk(2, dim=1)  # 2 x [s, b/2, d/t], strided: one split, no copy yet
        masks = _batch_halves(kwargs.get("attention_mask"), hidden.shape[1])

        def run(i):
            own = dict(kwargs, attention_mask=masks[i]) if "attention_mask" in kwargs else kwargs
            return self._forward_whole(views[i].contiguous(), args, own)[0]

        return join_halves(run_halves(run, [0, 1])), None  # [s, b, d/t]


def _batch_halves(mask, batch: int):
    """An attention mask's rows of each half: split along its batch dimension when it has
    one per sequence, else shared (None, or one mask broadcast over the batch)."""
    if mask is None or mask.dim() < 1 or mask.shape[0] != batch or batch == 1:
        return [mask, mask]
    return list(mask.chunk(2, dim=0))


def get_layer_spec(config: BoostTransformerConfig, tp_group) -> ModuleSpec:
    """The TransformerLayer spec of ``config.tp_mode``.

    ``tp_group`` is the real tensor-parallel group (naive passes it to its bottlenecks)."""
    backend = config.attention_backend
    if config.tp_mode is TPMode.FULL and backend == "te":
        # megatron's own TE layer: fused norm + linear, TE attention and MLP (docs/design.md
        # §10.12), with the canonical checkpoint keys to which the local spec maps its norms.
        return te_layer_spec()
    # A private copy: megatron may hand out the same spec object to every caller.
    spec = copy.deepcopy(local_layer_spec(normalization="RMSNorm"))
    spec_submodules(spec.submodules.self_attention).core_attention = core_attention_class(backend)
    if config.tp_mode is TPMode.FULL:
        if config.sequence_parallel:
            _sequence_parallel_norms(spec)
        return spec
    spec.module = BottleneckTransformerLayer
    if config.tp_mode is TPMode.NAIVE:
        _naive_slots(spec, tp_group)
        if backend == "te":  # naive's norms run on the replicated stream: TE's RMSNorm fits
            spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = te_norm()
    else:
        _boost_slots(spec)  # boost's norms are fused into its bottlenecks: TE attention only
    _bottleneck_blocks(spec, tp_group)  # last: the slots above are edited through megatron's
    return spec


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, as megatron's local spec builds it (``WrappedTorchNorm``), for a
    sequence-parallel layer. Each TP rank normalises only its sequence shard, so the weight's
    gradient is a partial sum: marking it ``sequence_parallel`` makes megatron's
    ``finalize_model_grads`` all-reduce it over the TP group, as megatron's apex and TE norms
    do. (``WrappedTorchNorm`` refuses sequence parallelism because it does not mark it.)"""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_ignored):
        super().__init__(hidden_size, eps=eps)
        setattr(self.weight, "sequence_parallel", config.sequence_parallel)


def _sequence_parallel_norms(spec: ModuleSpec) -> None:
    """The local spec's torch norms replaced by :class:`SequenceParallelRMSNorm`; megatron's
    own norms that support sequence parallelism (apex's FusedLayerNorm, where installed) are
    kept."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    sub = spec.submodules
    for slot in ("input_layernorm", "pre_mlp_layernorm"):
        if getattr(sub, slot) is WrappedTorchNorm:
            setattr(sub, slot, SequenceParallelRMSNorm)


def te_norm() -> type:
    """Transformer Engine's norm module (RMSNorm with config.normalization='RMSNorm')."""
    from megatron.core.extensions.transformer_engine import TENorm

    return TENorm


def _attention_and_mlp_slots(spec: ModuleSpec):
    """The linear slots of a layer spec's attention and MLP (the MLP's is a functools.partial
    from megatron-core 0.18 on: read through compat)."""
    sub = spec.submodules
    return spec_submodules(sub.self_attention), spec_submodules(sub.mlp)


def _bottleneck_blocks(spec: ModuleSpec, tp_group) -> None:
    """Attention and MLP that take the bottleneck groups' per-projection outputs
    (``model/blocks.py``) in place of megatron's fused qkv / fc1 layouts. The MLP gets the TP
    group megatron gives its own MLP (naive's linears take theirs from the spec)."""
    sub = spec.submodules
    sub.self_attention = with_module_class(sub.self_attention, BottleneckSelfAttention)
    sub.mlp = custom_mlp_slot(sub.mlp, BottleneckMLP, tp_group)


def _naive_slots(spec: ModuleSpec, tp_group) -> None:
    attn, mlp = _attention_and_mlp_slots(spec)
    group = {"bottleneck_tp_group": tp_group}
    # linear_qkv is called directly by SelfAttention (no build_module), so it gets a subclass
    # bound to the group rather than ModuleSpec params.
    attn.linear_qkv = type("NaiveLinearQKVBound", (NaiveLinearQKV,),
                           {"__init__": _bind_group(NaiveLinearQKV, tp_group)})
    attn.linear_proj = ModuleSpec(module=NaiveLinearProj, params=group)
    mlp.linear_fc1 = ModuleSpec(module=NaiveLinearFC1, params=group)
    mlp.linear_fc2 = ModuleSpec(module=NaiveLinearFC2, params=group)


def _boost_slots(spec: ModuleSpec) -> None:
    sub = spec.submodules
    attn, mlp = _attention_and_mlp_slots(spec)
    # Norms fused into the column layers; checkpoint keys stay those of a plain layer.
    attn.linear_qkv = BoostLinearQKV
    attn.linear_proj = BoostLinearProj
    mlp.linear_fc1 = BoostLinearFC1
    mlp.linear_fc2 = BoostLinearFC2
    # The norm slots mark the residual branch point and the bda slots hand the residual's
    # gradient to the A side's dgrad GEMM (parallel/residual.py).
    sub.input_layernorm = ResidualTap
    sub.pre_mlp_layernorm = ResidualTap
    sub.self_attn_bda = sub.mlp_bda = residual_bias_dropout_add
    # The fused norm weights are already named like megatron's canonical (TE-style) keys,
    # self_attention.linear_qkv.layer_norm_weight and mlp.linear_fc1.layer_norm_weight, to which
    # the local spec maps its separate norms: the same checkpoint keys in every mode
    # (docs/design.md §8).
    sub.sharded_state_dict_keys_map = {}


def _bind_group(cls, tp_group):
    def __init__(self, *args, **kwargs):
        kwargs["bottleneck_tp_group"] = tp_group
        cls.__init__(self, *args, **kwargs)
    return __init__
