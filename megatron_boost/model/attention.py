"""Core attention backends for the ``core_attention`` slot of megatron's SelfAttention.

* ``local``: megatron-core's DotProductAttention (baddbmm, masked softmax, bmm; materialises the
  [b, n, s, s] score matrix).
* ``sdpa``: :class:`SDPAttention`, the same module contract on
  ``torch.nn.functional.scaled_dot_product_attention`` (flash / memory-efficient kernels on
  CUDA, a fused kernel on CPU; no s×s matrix kept for backward).
* ``te``: Transformer Engine's TEDotProductAttention (CUDA only; megatron's TE extension).

Which one runs is decided by :func:`megatron_boost.runtime.backends.resolve_attention_backend`.
"""

from __future__ import annotations

import contextlib
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

__all__ = ["SDPAttention", "core_attention_class"]


class SDPAttention(DotProductAttention):
    """megatron's core attention computed by ``F.scaled_dot_product_attention``.

    Constructor and forward contract are DotProductAttention's (megatron-core 0.16): query
    [sq, b, n/t, e], key and value [sk, b, g/t, e] in, context [sq, b, n/t·e] out. The
    constructor is inherited, so head partitioning, the softmax scale and the dropout
    probability are megatron's own. Grouped-query attention uses SDPA's ``enable_gqa``, which
    repeats each key/value group over its consecutive query heads exactly as megatron's
    ``repeat_interleave`` does.

    Masks (megatron's convention: ``True`` = masked out):

    * ``causal``: the ``attention_mask`` argument is ignored and SDPA's ``is_causal`` applies the
      causal mask (the fast kernels need no mask tensor). This is the contract of TE's causal
      attention and of megatron's fused upper-triangular softmax: for GPT the mask megatron
      passes (if any) is the plain causal mask. Document masks (``reset_attention_mask``) need
      ``padding_causal`` or ``arbitrary``.
    * ``no_mask``: full attention.
    * ``padding``, ``arbitrary``: the given mask; ``padding_causal``: the given mask and causal.

    Dropout on the attention probabilities uses the module's probability (megatron's
    ``attention_dropout``) in training mode, inside megatron's tensor-parallel RNG fork as in
    DotProductAttention. Not supported (a clear error): packed sequences, attention bias,
    sliding windows, softmax types other than vanilla, context parallelism.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None):
        _check_supported_config(config)
        super().__init__(config, layer_number, attn_mask_type, attention_type,
                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                         cp_comm_type=cp_comm_type, pg_collection=pg_collection)
        # With apply_query_key_layer_scaling megatron divides the scale by the layer number and
        # multiplies the scores back inside its softmax (an fp16 range guard): the net scale is
        # the one SDPA gets.
        self.sdpa_scale = self.softmax_scale * (
            self.layer_number if config.apply_query_key_layer_scaling else 1)
        self.gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None:
            raise ValueError("SDPAttention does not support packed sequences (packed_seq_params"
                             "); use model.attention_backend=te on CUDA for THD packing")
        if attention_bias is not None:
            raise ValueError("SDPAttention does not support attention_bias")
        is_causal, keep = _sdpa_mask(attn_mask_type or self.attn_mask_type, attention_mask,
                                     query.shape[0], key.shape[0])
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, e]
        dropout_p = self.attention_dropout.p if self.training else 0.0
        with self._dropout_rng():
            context = F.scaled_dot_product_attention(
                q, k, v, attn_mask=keep, dropout_p=dropout_p, is_causal=is_causal,
                scale=self.sdpa_scale, enable_gqa=self.gqa)  # [b, n/t, sq, e]
        sq, b = query.shape[0], query.shape[1]
        # [b, n/t, sq, e] -> [sq, b, n/t, e] -> [sq, b, n/t·e]
        return context.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _dropout_rng(self):
        """megatron's rule: attention dropout draws from the tensor-parallel RNG fork unless
        sequence parallelism is on (DotProductAttention.forward)."""
        if self.attention_dropout.p == 0.0 or not self.training or self.config.sequence_parallel:
            return contextlib.nullcontext()
        return tensor_parallel.get_cuda_rng_tracker().fork()


def _check_supported_config(config) -> None:
    if config.softmax_type != "vanilla":
        raise ValueError(f"SDPAttention supports softmax_type 'vanilla' only, got "
                         f"{config.softmax_type!r}; use model.attention_backend=local")
    if config.window_size is not None:
        raise ValueError("SDPAttention does not support sliding-window attention "
                         "(window_size); use model.attention_backend=local or te")
    if config.context_parallel_size != 1:
        raise ValueError("SDPAttention does not support context parallelism; use "
                         "model.attention_backend=te")


def _sdpa_mask(mask_type: AttnMaskType, attention_mask: Optional[torch.Tensor], sq: int,
               sk: int) -> Tuple[bool, Optional[torch.Tensor]]:
    """(is_causal, boolean keep-mask or None) for SDPA from megatron's mask type and mask
    (megatron: True = masked out; SDPA: True = attend)."""
    if mask_type == AttnMaskType.causal:
        return True, None
    if mask_type == AttnMaskType.no_mask:
        return False, None
    if attention_mask is None:
        raise ValueError(f"attention mask type {mask_type.name} needs an attention_mask")
    keep = ~attention_mask  # [b or 1, 1 or n, sq, sk]
    if mask_type == AttnMaskType.padding_causal:
        keep = keep & torch.ones(sq, sk, dtype=torch.bool, device=keep.device).tril()
    return False, keep


def core_attention_class(backend: str) -> type:
    """The module for the ``core_attention`` slot of a resolved backend (sdpa, local, te)."""
    if backend == "sdpa":
        return SDPAttention
    if backend == "local":
        return DotProductAttention
    if backend == "te":
        # Without transformer_engine megatron's extension module still imports, with mock
        # classes: refuse here instead of failing inside the first forward.
        from megatron.core.extensions.transformer_engine import HAVE_TE, TEDotProductAttention

        if not HAVE_TE:
            raise ValueError("attention backend te: transformer_engine does not import")
        return TEDotProductAttention
    raise ValueError(f"attention backend {backend!r} is not one of sdpa, local, te "
                     f"(resolve 'auto' first)")
