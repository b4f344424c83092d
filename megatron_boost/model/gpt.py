"""The bottleneck GPT model of the three TP modes (a megatron-core GPTModel subclass).

The decoder layers come from :mod:`megatron_boost.model.specs`. Around them:

* full:  megatron-core's own embedding, final RMSNorm and output layer.
* naive: the decoder is built with a one-rank "TP" group (see specs); the embedding and the
         head stay vocab-parallel over the real TP group, as in megatron.
* boost: the residual stream is hidden-sharded [s, b, d/t] from the embedding
         (:class:`HiddenShardedEmbedding`, table sharded along d, no collective) to the head
         (:class:`GatheredRMSNorm`: one all-gather, then megatron's vocab-parallel output layer
         and loss), docs/design.md §2.

Tied embeddings (``config.share_embeddings_and_output_weights``) are megatron's own mechanism
in every mode: one vocab-parallel table [V/t, d] that the output layer reads; with pp > 1 the
last stage's copy is kept equal by megatron's embedding-group gradient all-reduce. boost's tied
embedding (:class:`TiedHiddenShardedEmbedding`) looks up that table and reduce-scatters the
partial rows to the hidden shards (docs/design.md §2).

Pipeline stages of a boost model exchange the local shard [s, b, d/t] (docs/design.md §6).
megatron-core's schedules allocate p2p buffers of shape (seq_length, micro_batch, hidden_size);
the boost model is therefore driven with ``seq_length = s / t`` (see
:func:`schedule_seq_length`) and views its stage output [s, b, d/t] as [s/t, b, d] (same
elements, same memory) and its stage input back.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import get_pg_rank, get_pg_size

from megatron_boost.config.modes import TPMode, check_pipeline_seq_length
from megatron_boost.config.placement import Tensor, tensor_local_shape, tensor_split
from megatron_boost.config.transformer import BoostTransformerConfig
from megatron_boost.model.specs import (
    default_pg_collection,
    get_layer_spec,
    replicated_decoder_pgs,
    te_norm,
)
from megatron_boost.parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    reduce_scatter_to_hidden_shards,
)

__all__ = [
    "BottleneckGPTModel", "GatheredRMSNorm", "HiddenShardedEmbedding",
    "TiedHiddenShardedEmbedding", "build_model", "schedule_seq_length", "stream_split",
    "p2p_to_stream", "stream_to_p2p",
]


def stream_split(mode, tp: int) -> Optional[int]:
    """The axis of the residual stream [s, b, d] split between ``tp`` ranks (and so between
    pipeline stages) in ``mode``, from the placement table; None: whole (boost: 2)."""
    return tensor_split(mode, Tensor.STREAM) if tp > 1 else None


def schedule_seq_length(config: BoostTransformerConfig, seq_length: int) -> int:
    """The seq_length to hand megatron-core's schedules (p2p buffer shape, see module doc):
    s/t where the placement table splits the stream between stages (boost)."""
    if (stream_split(config.tp_mode, config.tensor_model_parallel_size) is not None
            and config.pipeline_model_parallel_size > 1):
        tp = config.tensor_model_parallel_size
        check_pipeline_seq_length(config.tp_mode, tp, config.pipeline_model_parallel_size,
                                  seq_length)
        return seq_length // tp
    return seq_length


class GatheredRMSNorm(MegatronModule):
    """boost's final norm: all-gather the hidden shards [s, b, d/t] -> [s, b, d], then RMSNorm
    with a replicated weight [d] (the only parameter not sharded in boost mode)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, tp_group=None):
        super().__init__(config=config)
        self.tp_group = tp_group
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))

    def forward(self, x):
        x = gather_from_tensor_model_parallel_region(x, group=self.tp_group)  # [s, b, d]
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def get_block_spec(config: BoostTransformerConfig, tp_group, vp_stage=None,
                   pp_rank=None) -> TransformerBlockSubmodules:
    layer = get_layer_spec(config, tp_group)
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    if config.tp_mode is TPMode.BOOST:
        norm = ModuleSpec(module=GatheredRMSNorm, params={"tp_group": tp_group})
    elif config.attention_backend == "te":
        norm = te_norm()  # the TE full-rank layer fuses its norms: its input_layernorm is Identity
    else:
        norm = layer.submodules.input_layernorm  # megatron's RMSNorm (local spec)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=norm)


class HiddenShardedEmbedding(MegatronModule):
    """boost's word embedding: table [V, d/t], sharded along the hidden dimension, so the
    lookup yields this rank's hidden shard [s, b, d/t] with no communication; megatron's
    embedding dropout (``hidden_dropout``) follows, as in its LanguageModelEmbedding (only at
    TP 1: config/validation.py's ``_check_dropout``)."""

    def __init__(self, config, vocab_size: int, tp_group):
        super().__init__(config=config)
        self.tp_group = tp_group
        t = get_pg_size(tp_group)
        # [V, d] split as the placement table says (boost: along d)
        self.split_axis = tensor_split(config.tp_mode, Tensor.EMBEDDING)
        shape = tensor_local_shape(config.tp_mode, Tensor.EMBEDDING,
                                   (vocab_size, config.hidden_size), t)
        # torch's own normal init only where megatron would initialise (docs/design.md §8)
        initial = None if config.perform_initialization else torch.empty(
            shape, dtype=config.params_dtype)
        self.word_embeddings = torch.nn.Embedding(*shape, dtype=config.params_dtype,
                                                  _weight=initial)
        set_tensor_model_parallel_attributes(self.word_embeddings.weight, True,
                                             self.split_axis, 1)
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)  # megatron's

    def forward(self, input_ids, position_ids=None, tokentype_ids=None):
        emb = self.word_embeddings(input_ids)  # [b, s, d/t]
        return self.embedding_dropout(emb.transpose(0, 1).contiguous())  # [s, b, d/t]

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        dp_cp = (metadata or {}).get("dp_cp_group") or parallel_state.get_data_parallel_group(
            with_context_parallel=True)
        return make_sharded_tensors_for_checkpoint(
            self.word_embeddings.state_dict(keep_vars=True), f"{prefix}word_embeddings.",
            {"weight": self.split_axis}, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=dp_cp)


class TiedHiddenShardedEmbedding(MegatronModule):
    """boost's word embedding when it is tied to the output layer: the table is megatron's
    vocab-parallel one [V/t, d] (the tensor the output layer reads, saved and resharded as
    megatron saves it). Each rank looks up the tokens of its vocabulary slice (zeros elsewhere),
    and a reduce-scatter along d turns the partial rows into this rank's hidden shard
    [s, b, d/t]: the volume of the head's all-gather, once per micro-batch (docs/design.md
    §2)."""

    def __init__(self, config, vocab_size: int, tp_group):
        super().__init__(config=config)
        self.tp_group = tp_group
        self.word_embeddings = VocabParallelEmbedding(
            num_embeddings=vocab_size, embedding_dim=config.hidden_size,
            init_method=config.init_method, config=config, tp_group=tp_group)
        self.embedding_dropout = torch.nn.Dropout(config.hidden_dropout)  # megatron's

    def forward(self, input_ids, position_ids=None, tokentype_ids=None):
        table = self.word_embeddings
        outside = (input_ids < table.vocab_start_index) | (input_ids >= table.vocab_end_index)
        local_ids = (input_ids - table.vocab_start_index).masked_fill(outside, 0)
        rows = F.embedding(local_ids, table.weight)  # [b, s, d]: partial, this vocab slice
        rows = rows.masked_fill(outside.unsqueeze(-1), 0.0)
        shard = reduce_scatter_to_hidden_shards(rows, self.tp_group)  # [b, s, d/t]
        return self.embedding_dropout(shard.transpose(0, 1).contiguous())  # [s, b, d/t]


class BottleneckGPTModel(GPTModel):
    """megatron-core GPTModel for the three modes (RoPE; tied or untied embeddings).

    Args:
        config: the model config; ``config.tp_mode`` selects the mode.
        vocab_size: padded vocabulary size (``config.resolved.padded_vocab_size``).
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
        decoder_pgs = replicated_decoder_pgs(pgs) if mode is TPMode.NAIVE else pgs
        spec = get_block_spec(config, tp_group, vp_stage=vp_stage,
                              pp_rank=get_pg_rank(pgs.pp))
        super().__init__(
            config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
            max_sequence_length=max_sequence_length, pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=config.share_embeddings_and_output_weights,
            position_embedding_type="rope", rotary_base=rotary_base,
            pg_collection=decoder_pgs, vp_stage=vp_stage)
        self.tp_mode = mode
        self.real_pg_collection = pgs
        self.tp_size = get_pg_size(tp_group)
        if mode is TPMode.NAIVE:
            self._vocab_parallel_ends(vocab_size, max_sequence_length)
        elif mode is TPMode.BOOST and pre_process:
            tied = self.share_embeddings_and_output_weights
            self.embedding = (TiedHiddenShardedEmbedding if tied else HiddenShardedEmbedding)(
                config, vocab_size, tp_group)
        self._ends_built = True
        self.setup_embeddings_and_output_layer()

    def setup_embeddings_and_output_layer(self) -> None:
        """megatron's set-up of the embedding and the output layer (tying included: the
        attributes of the shared weight and, with pp > 1, the first/last-stage weight sync),
        run once on the final modules. The call at the end of GPTModel's __init__ is skipped:
        naive and boost replace those modules afterwards, and it would set up (and all-reduce
        over the embedding group) a table about to be discarded."""
        if getattr(self, "_ends_built", False):
            super().setup_embeddings_and_output_layer()

    def _vocab_parallel_ends(self, vocab_size: int, max_sequence_length: int) -> None:
        """naive: GPTModel built the embedding and head with the one-rank decoder group;
        rebuild them vocab-parallel over the real TP group, as in megatron (docs/design.md
        §10.9)."""
        config, tp_group = self.config, self.real_pg_collection.tp
        # LanguageModule keeps both; the vocab-parallel loss reads tp_group (megatron-core 0.19;
        # earlier versions took parallel_state's group there).
        self.pg_collection, self.tp_group = self.real_pg_collection, tp_group
        if self.pre_process:
            self.embedding = LanguageModelEmbedding(
                config=config, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                position_embedding_type="rope", tp_group=tp_group)
        if self.post_process:
            self.output_layer = ColumnParallelLinear(
                config.hidden_size, vocab_size, config=config, init_method=config.init_method,
                bias=False, skip_bias_add=False, gather_output=False,
                skip_weight_param_allocation=(self.pre_process
                                              and self.share_embeddings_and_output_weights),
                tp_group=tp_group)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        sd = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.tp_mode is TPMode.NAIVE and self.tp_size > 1:
            # The naive decoder was built with a one-rank TP group, so everything its modules
            # save as a replica (the norm weights, the modules' extra state) would claim TP
            # replica 0 on every TP rank, and dist_checkpointing refuses to save ("Duplicate
            # ShardedObject keys", or an invalid access pattern): number them by the real TP
            # rank, so that TP rank 0 saves them.
            _number_tp_replicas(sd, get_pg_rank(self.real_pg_collection.tp))
        return sd

    # Pipeline stage boundaries where the table splits the stream (boost: [s, b, d/t]): the
    # local stream travels as megatron's [s/t, b, d] buffer.
    def set_input_tensor(self, input_tensor) -> None:
        axis = stream_split(self.tp_mode, self.tp_size)
        if axis is not None:
            tensors = input_tensor if isinstance(input_tensor, list) else [input_tensor]
            input_tensor = [None if t is None else p2p_to_stream(t, axis, self.tp_size)
                            for t in tensors]
        super().set_input_tensor(input_tensor)

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        axis = stream_split(self.tp_mode, self.tp_size)
        if (axis is not None and not self.post_process
                and self.config.pipeline_model_parallel_size > 1):
            out = stream_to_p2p(out, axis, self.tp_size)
        return out


def p2p_to_stream(buffer: torch.Tensor, axis: int, tp: int) -> torch.Tensor:
    """megatron's p2p buffer [s/t, b, d] viewed as the local stream split along ``axis``
    (boost: 2, [s, b, d/t]); the same elements, no copy."""
    shape = list(buffer.shape)
    shape[0] *= tp
    shape[axis] //= tp
    return buffer.view(shape)  # [s/t, b, d] -> boost: [s, b, d/t]


def stream_to_p2p(stream: torch.Tensor, axis: int, tp: int) -> torch.Tensor:
    """The local stream split along ``axis`` (boost: [s, b, d/t]) viewed as megatron's p2p
    buffer [s/t, b, d]; the same elements, no copy."""
    shape = list(stream.shape)
    shape[axis] *= tp
    shape[0] //= tp
    return stream.view(shape)  # boost: [s, b, d/t] -> [s/t, b, d]


def _replicated_over_tp(sh) -> bool:
    """Whether a piece of a sharded state dict is the same on every TP rank: a tensor not split
    along any of its own (not prepended) axes, and every ShardedObject, which megatron makes for
    a module's state replicated across TP and DP (``make_sharded_object_for_checkpoint`` in
    megatron/core/transformer/utils.py; its global shape holds the prepended layer axis only).
    Factories (a grouped A, parallel/layers.py) come only from layers on the real TP group, which
    shard them."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    if isinstance(sh, ShardedObject):
        return True
    return isinstance(sh, ShardedTensor) and all(
        f == 1 for f in sh.axis_fragmentations[sh.prepend_axis_num:])


def _number_tp_replicas(sharded_sd: dict, tp_rank: int) -> None:
    """Give every piece replicated over TP the TP rank as the TP index of its replica id
    (the second of megatron's replica tuple ``(0, tp rank, dp rank)``), in place."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    for sh in nested_values(sharded_sd):
        if _replicated_over_tp(sh) and isinstance(sh.replica_id, tuple):
            sh.replica_id = (sh.replica_id[0], tp_rank, *sh.replica_id[2:])


def build_model(config: BoostTransformerConfig, vocab_size: int, max_sequence_length: int,
                pg_collection: Optional[ProcessGroupCollection] = None,
                rotary_base: int = 10000) -> List[BottleneckGPTModel]:
    """The model chunks of this rank (one, or ``vpp`` with interleaving)."""
    pgs = pg_collection or default_pg_collection()
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
