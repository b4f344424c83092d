"""Layer specs for the three TP modes and the bottleneck GPT model (megatron-core GPTModel).

* full:  megatron-core's local spec (RMSNorm, SwiGLU, RoPE, no biases): the full-rank baseline.
* naive: the naive bottleneck linears in the four linear slots. Attention, the MLP activation
         and the norms run on the replicated stream, duplicated on every TP rank, so the
         decoder is built with a one-rank "TP" group and the bottlenecks receive the real TP
         group from the spec; embedding and head stay vocab-parallel over the real group.
* boost: BoostLinearQKV / BoostLinearFC1 (fused online-RMSNorm) and BoostLinearRow; IdentityOp
         for input_layernorm / pre_mlp_layernorm; the residual stream is hidden-sharded
         [s, b, d/t] from the embedding (table sharded along d, no collective) to the head
         (one all-gather, final RMSNorm, megatron's vocab-parallel output layer and loss).

Pipeline stages of a boost model exchange the local shard [s, b, d/t]. megatron-core's
schedules allocate p2p buffers of shape (seq_length, micro_batch, hidden_size); the boost model
is therefore driven with ``seq_length = s / t`` (see :func:`schedule_seq_length`) and views its
stage output [s, b, d/t] as [s/t, b, d] (same elements, same memory) and its stage input back.
"""

from __future__ import annotations

import contextlib
import copy
import math
import zlib
from typing import Iterable, List, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)

from megatron_boost.parallel import mappings as comm
from megatron_boost.config.transformer import BoostTransformerConfig, TPMode
from megatron_boost.model.layers import (
    BoostLinearFC1,
    BoostLinearQKV,
    BoostLinearRow,
    NaiveLinearFC1,
    NaiveLinearQKV,
    NaiveLinearRow,
)

__all__ = [
    "get_layer_spec", "BottleneckGPTModel", "build_model", "init_global_weights",
    "padded_vocab_size", "schedule_seq_length", "default_pg_collection", "sharded_params",
]


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """Vocabulary padded to a multiple of lcm(128, tp): the same global size at every TP size
    that divides 128, so checkpoints move between layouts."""
    m = multiple * tp // math.gcd(multiple, tp)
    return int(math.ceil(vocab_size / m) * m)


def schedule_seq_length(config: BoostTransformerConfig, seq_length: int) -> int:
    """The seq_length to hand megatron-core's schedules (p2p buffer shape, see module doc)."""
    if config.tp_mode is TPMode.BOOST and config.pipeline_model_parallel_size > 1:
        tp = config.tensor_model_parallel_size
        if seq_length % tp:
            raise ValueError(
                f"seq_length ({seq_length}) must be divisible by tensor_model_parallel_size "
                f"({tp}) for boost with pipeline parallelism: stages exchange the [s, b, d/t] "
                f"shard as an [s/t, b, d] buffer")
        return seq_length // tp
    return seq_length


# ---------------------------------------------------------------------------------------------
# process groups
# ---------------------------------------------------------------------------------------------

_SELF_GROUP = {}


def _self_group():
    """A process group holding only this rank (created collectively, once)."""
    if "group" not in _SELF_GROUP:
        world, rank = dist.get_world_size(), dist.get_rank()
        for r in range(world):  # every rank must create every group, in the same order
            g = dist.new_group([r])
            if r == rank:
                _SELF_GROUP["group"] = g
    return _SELF_GROUP["group"]


def default_pg_collection() -> ProcessGroupCollection:
    """megatron-core's process groups (parallel_state must be initialised)."""
    return ProcessGroupCollection.use_mpu_process_groups()


def _replicated_decoder_pgs(pgs: ProcessGroupCollection) -> ProcessGroupCollection:
    """The naive decoder's groups: TP replaced by a one-rank group (attention, MLP activation
    and norms run on the full, replicated tensors)."""
    naive = copy.copy(pgs)
    naive.tp = _self_group()
    if hasattr(pgs, "tp_cp"):
        naive.tp_cp = pgs.cp if hasattr(pgs, "cp") else naive.tp
    return naive


# ---------------------------------------------------------------------------------------------
# specs
# ---------------------------------------------------------------------------------------------


class GatheredRMSNorm(MegatronModule):
    """boost's final norm: all-gather the hidden shards [s, b, d/t] -> [s, b, d], then RMSNorm
    with a replicated weight [d] (the only parameter not sharded in boost mode)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, tp_group=None):
        super().__init__(config=config)
        self.tp_group = tp_group
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x):
        x = comm.gather_hidden(x, self.tp_group)  # [s, b, d]
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class _LowRankCheckpoint(torch.autograd.Function):
    """Low-rank activation checkpointing of one decoder layer (BOOST).

    fwd: runs the layer without building a graph, recording the results of its forward
         all-reduces (boost: the r + 1 wide bottleneck sums, which carry the rms sums of
         squares; naive: the reduced chunk outputs); saves only the layer input (boost: the
         hidden shard [s, b, d/t]) and those results.
    bwd: re-runs the layer with the recorded reductions replayed (no collective is re-run),
         then back-propagates through it; the backward collectives are the usual ones.
    """

    @staticmethod
    def forward(ctx, run_fn, hidden, *unused):
        store = []
        ctx.run_fn = run_fn
        ctx.rng = torch.get_rng_state()
        # The autograd engine runs backward with an empty torch-function-mode stack; the
        # recompute must see the same modes as the forward (CPU mode is one).
        ctx.modes = torch.overrides._get_current_function_mode_stack()
        with torch.no_grad(), comm.record_forward_reductions(store):
            out = run_fn(hidden)
        ctx.n_cached = len(store)
        ctx.save_for_backward(hidden, *store)
        return out

    @staticmethod
    def backward(ctx, grad):
        hidden, *store = ctx.saved_tensors
        hidden = hidden.detach().requires_grad_(hidden.requires_grad)
        rng = torch.get_rng_state()
        torch.set_rng_state(ctx.rng)
        with contextlib.ExitStack() as modes:
            for mode in ctx.modes:
                modes.enter_context(mode)
            with torch.enable_grad(), comm.replay_forward_reductions(store):
                out = ctx.run_fn(hidden)
        torch.set_rng_state(rng)
        torch.autograd.backward(out, grad)
        return (None, hidden.grad)


class BottleneckTransformerLayer(TransformerLayer):
    """megatron's TransformerLayer with optional low-rank activation checkpointing
    (``config.lowrank_recompute``); otherwise unchanged."""

    def forward(self, *args, **kwargs):
        if not (self.config.lowrank_recompute and self.training and torch.is_grad_enabled()):
            return super().forward(*args, **kwargs)
        if args:
            hidden, args = args[0], args[1:]
        else:
            hidden = kwargs.pop("hidden_states")

        def run(h):
            return super(BottleneckTransformerLayer, self).forward(h, *args, **kwargs)[0]

        return _LowRankCheckpoint.apply(run, hidden), None


def get_layer_spec(config: BoostTransformerConfig, tp_group) -> ModuleSpec:
    """The TransformerLayer spec of ``config.tp_mode``.

    ``tp_group`` is the real tensor-parallel group (naive passes it to its bottlenecks)."""
    # A private copy: megatron may hand out the same spec object to every caller.
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
    sub = spec.submodules
    attn, mlp = sub.self_attention.submodules, sub.mlp.submodules
    if config.tp_mode is TPMode.FULL:
        return spec
    spec.module = BottleneckTransformerLayer
    if config.tp_mode is TPMode.NAIVE:
        group = {"bottleneck_tp_group": tp_group}
        # linear_qkv is called directly by SelfAttention (no build_module), so it gets a
        # subclass bound to the group rather than ModuleSpec params.
        attn.linear_qkv = type("NaiveLinearQKVBound", (NaiveLinearQKV,),
                               {"__init__": _bind_group(NaiveLinearQKV, tp_group)})
        attn.linear_proj = ModuleSpec(module=NaiveLinearRow, params=group)
        mlp.linear_fc1 = ModuleSpec(module=NaiveLinearFC1, params=group)
        mlp.linear_fc2 = ModuleSpec(module=NaiveLinearRow, params=group)
        return spec
    # boost: norms fused into the column layers; checkpoint keys stay those of a plain layer.
    attn.linear_qkv = BoostLinearQKV
    attn.linear_proj = BoostLinearRow
    mlp.linear_fc1 = BoostLinearFC1
    mlp.linear_fc2 = BoostLinearRow
    sub.input_layernorm = IdentityOp
    sub.pre_mlp_layernorm = IdentityOp
    # The fused norm weights are already named like megatron's canonical (TE-style) keys,
    # self_attention.linear_qkv.layer_norm_weight and mlp.linear_fc1.layer_norm_weight, to which
    # the local spec maps its separate norms: the same checkpoint keys in every mode.
    sub.sharded_state_dict_keys_map = {}
    return spec


def _bind_group(cls, tp_group):
    def __init__(self, *args, **kwargs):
        kwargs["bottleneck_tp_group"] = tp_group
        cls.__init__(self, *args, **kwargs)
    return __init__


def get_block_spec(config: BoostTransformerConfig, tp_group, vp_stage=None,
                   pp_rank=None) -> TransformerBlockSubmodules:
    layer = get_layer_spec(config, tp_group)
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    if config.tp_mode is TPMode.BOOST:
        norm = ModuleSpec(module=GatheredRMSNorm, params={"tp_group": tp_group})
    else:
        norm = layer.submodules.input_layernorm  # megatron's RMSNorm (local spec)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=norm)


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------


class HiddenShardedEmbedding(MegatronModule):
    """boost's word embedding: table [V, d/t], sharded along the hidden dimension, so the
    lookup yields this rank's hidden shard [s, b, d/t] with no communication."""

    def __init__(self, config, vocab_size: int, tp_group):
        super().__init__(config=config)
        self.tp_group = tp_group
        t = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.word_embeddings = torch.nn.Embedding(vocab_size, config.hidden_size // t,
                                                  dtype=config.params_dtype)
        set_tensor_model_parallel_attributes(self.word_embeddings.weight, True, 1, 1)

    def forward(self, input_ids, position_ids=None, tokentype_ids=None):
        emb = self.word_embeddings(input_ids)  # [b, s, d/t]
        return emb.transpose(0, 1).contiguous()  # [s, b, d/t]

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        dp_cp = (metadata or {}).get("dp_cp_group") or parallel_state.get_data_parallel_group(
            with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint(
            self.word_embeddings.state_dict(keep_vars=True), f"{prefix}word_embeddings.",
            {"weight": 1}, sharded_offsets, tp_group=self.tp_group, dp_cp_group=dp_cp)


class BottleneckGPTModel(GPTModel):
    """megatron-core GPTModel for the three modes (untied embeddings, RoPE).

    Args:
        config: the model config; ``config.tp_mode`` selects the mode.
        vocab_size: padded vocabulary size (see :func:`padded_vocab_size`).
        max_sequence_length: the longest sequence (RoPE table size).
        pg_collection: megatron's process groups for this rank (``.tp`` is the real TP group).
    """

    def __init__(self, config: BoostTransformerConfig, vocab_size: int,
                 max_sequence_length: int, pre_process: bool = True, post_process: bool = True,
                 pg_collection: Optional[ProcessGroupCollection] = None,
                 vp_stage: Optional[int] = None, rotary_base: int = 10000):
        pgs = pg_collection or default_pg_collection()
        tp_group = pgs.tp
        mode = config.tp_mode
        decoder_pgs = _replicated_decoder_pgs(pgs) if mode is TPMode.NAIVE else pgs
        from megatron.core.utils import get_pg_rank
        spec = get_block_spec(config, tp_group, vp_stage=vp_stage,
                              pp_rank=get_pg_rank(pgs.pp))
        super().__init__(
            config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
            max_sequence_length=max_sequence_length, pre_process=pre_process,
            post_process=post_process, share_embeddings_and_output_weights=False,
            position_embedding_type="rope", rotary_base=rotary_base,
            pg_collection=decoder_pgs, vp_stage=vp_stage)
        self.tp_mode = mode
        self.real_pg_collection = pgs
        self.tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
        if mode is TPMode.NAIVE:
            # Built above with the one-rank group; the embedding and head are vocab-parallel
            # over the real TP group, as in megatron.
            self.pg_collection = pgs
            if pre_process:
                self.embedding = LanguageModelEmbedding(
                    config=config, vocab_size=vocab_size,
                    max_sequence_length=max_sequence_length, position_embedding_type="rope",
                    tp_group=tp_group)
            if post_process:
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size, vocab_size, config=config,
                    init_method=config.init_method, bias=False, skip_bias_add=False,
                    gather_output=False, skip_weight_param_allocation=False,
                    tp_group=tp_group)
        elif mode is TPMode.BOOST and pre_process:
            self.embedding = HiddenShardedEmbedding(config, vocab_size, tp_group)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.tp_mode is TPMode.NAIVE and self.tp_size > 1:
            # The naive decoder was built with a one-rank TP group, so its replicated tensors
            # (the RMSNorm weights) would each claim TP replica 0 on every TP rank, and
            # dist_checkpointing refuses to save. A tensor unsharded along every axis is a
            # replica on each TP rank: give it the real TP rank as its replica index.
            from megatron.core.dist_checkpointing.dict_utils import nested_values
            from megatron.core.dist_checkpointing.mapping import ShardedTensor

            tp_rank = dist.get_rank(self.real_pg_collection.tp)
            for sh in nested_values(sd):
                if isinstance(sh, ShardedTensor) and all(
                        f == 1 for f in sh.axis_fragmentations[sh.prepend_axis_num:]):
                    sh.replica_id = (sh.replica_id[0], tp_rank, sh.replica_id[2])
        return sd

    # Pipeline stage boundaries of boost: [s, b, d/t] travels as an [s/t, b, d] buffer.
    def set_input_tensor(self, input_tensor) -> None:
        if self.tp_mode is TPMode.BOOST and self.tp_size > 1:
            tensors = input_tensor if isinstance(input_tensor, list) else [input_tensor]
            input_tensor = [self._from_p2p(t) for t in tensors]
        super().set_input_tensor(input_tensor)

    def _from_p2p(self, t):
        if t is None:
            return None
        s_t, b, d = t.shape
        return t.view(s_t * self.tp_size, b, d // self.tp_size)  # [s, b, d/t]

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        if (self.tp_mode is TPMode.BOOST and self.tp_size > 1 and not self.post_process
                and self.config.pipeline_model_parallel_size > 1):
            s, b, d_t = out.shape
            out = out.view(s // self.tp_size, b, d_t * self.tp_size)  # [s/t, b, d]
        return out


def build_model(config: BoostTransformerConfig, vocab_size: int, max_sequence_length: int,
                pg_collection: Optional[ProcessGroupCollection] = None,
                rotary_base: int = 10000) -> List[BottleneckGPTModel]:
    """The model chunks of this rank (one, or ``vpp`` with interleaving)."""
    pgs = pg_collection or default_pg_collection()
    from megatron.core.utils import get_pg_rank, get_pg_size

    pp_rank, pp_size = get_pg_rank(pgs.pp), get_pg_size(pgs.pp)
    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for v in range(vpp or 1):
        vp_stage = v if vpp else None
        pre = pp_rank == 0 and v == 0
        post = pp_rank == pp_size - 1 and v == (vpp or 1) - 1
        chunks.append(BottleneckGPTModel(
            config, vocab_size, max_sequence_length, pre_process=pre, post_process=post,
            pg_collection=pgs, vp_stage=vp_stage, rotary_base=rotary_base))
    return chunks


# ---------------------------------------------------------------------------------------------
# layout-independent initialisation
# ---------------------------------------------------------------------------------------------


def sharded_params(model: torch.nn.Module, prefix: str = ""):
    """(global key, global shape, local slice of the global tensor -> local tensor, param) for
    every parameter, from the model's sharded_state_dict (so global names and shapes follow
    megatron's own checkpoint metadata, whatever the layout)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    by_ptr = {p.data_ptr(): p for p in model.parameters()}
    out = []
    for sh in nested_values(model.sharded_state_dict(prefix=prefix)):
        data = getattr(sh, "data", None)
        param = by_ptr.get(data.data_ptr()) if isinstance(data, torch.Tensor) else None
        if param is None:
            continue
        if isinstance(sh, ShardedTensorFactory):
            # megatron's gated fc1 (full mode) saves its local [gate_k; up_k] as two pieces of
            # the global [gate; up]: the local tensor is their concatenation along dim 0.
            pieces = [p for p in nested_values(sh.build()) if isinstance(p, ShardedTensor)]
        elif isinstance(sh, ShardedTensor):
            pieces = [sh]
        else:
            continue
        first = pieces[0]
        # Layers are stacked along prepended axes (the global layer index): they become part
        # of the identity, "decoder.layers.mlp.linear_fc1.A_up@3".
        pre = first.prepend_axis_num
        key = first.key if not pre else (
            first.key + "@" + ".".join(str(o) for o in first.global_offset[:pre]))
        out.append((key, tuple(first.global_shape[pre:]), _slicer(pieces), param))
    return out


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


def _init_rule(key: str, shape, shapes_by_key, config, gen) -> torch.Tensor:
    base, at, layer = key.partition("@")
    name = base.rsplit(".", 1)[-1]
    if "layernorm" in key or name == "layer_norm_weight" or key.endswith("norm.weight"):
        return torch.ones(shape)
    if name.startswith(("A_", "B_")) and config.cola_init:
        proj = name[2:]
        a_shape = shapes_by_key[f"{base[: -len(name)]}A_{proj}{at}{layer}"]
        b_shape = shapes_by_key[f"{base[: -len(name)]}B_{proj}{at}{layer}"]
        rank, d_in, d_out = a_shape[0], a_shape[1], b_shape[0]
        return torch.randn(shape, generator=gen) * (rank ** -0.25 * (d_in + d_out) ** -0.25)
    std = config.init_method_std
    if name.startswith("B_") or "linear_proj" in key or "linear_fc2" in key:
        std = std / math.sqrt(2.0 * config.num_layers)  # megatron's scaled output init
    return torch.randn(shape, generator=gen) * std


def init_global_weights(chunks: Iterable[torch.nn.Module], seed: int,
                        config: BoostTransformerConfig) -> None:
    """Initialise every parameter from ``seed`` and its global checkpoint key, so the global
    (unsharded) weights are identical for every mode that shares the key and every TP/PP
    layout. Each global tensor is drawn from its own generator and sliced."""
    entries = [e for chunk in chunks for e in sharded_params(chunk)]
    shapes = {key: shape for key, shape, _, _ in entries}
    with torch.no_grad():
        for key, shape, slicer, param in entries:
            gen = torch.Generator().manual_seed(seed ^ zlib.crc32(key.encode()))
            full = _init_rule(key, shape, shapes, config, gen)
            local = slicer(full)
            if local.shape != param.shape:
                raise RuntimeError(f"init of {key}: slice {tuple(local.shape)} of global "
                                   f"{tuple(shape)} does not match the parameter "
                                   f"{tuple(param.shape)}")
            param.copy_(local.to(param.dtype))
