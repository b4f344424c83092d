"""Analytic model FLOPs per token, achieved TFLOP/s and MFU.

The count is of *model* FLOPs: matrix multiplications only (norms, activations, softmax,
rotary embeddings and the loss are ignored, as in Megatron's and PaLM's MFU accounting), for
the model the config describes, independent of the parallel layout. In particular the naive
TP mode duplicates attention and the MLP activation on every TP rank; that duplicated work is
*not* counted (it is waste, not useful model work), so naive and boost have the same
FLOPs per token and their MFU compares directly.

Per token, forward pass, per decoder layer (d hidden, f ffn, h heads, g query groups,
e head dim, r the bottleneck ranks, s sequence length):

* a dense projection d_in -> d_out costs 2·d_in·d_out;
* a bottleneck projection y = B·σ(A·x) costs 2·r·(d_in + d_out) (A: d_in -> r, B: r -> d_out);
* q: d -> h·e, k and v: d -> g·e, o: h·e -> d; gate and up: d -> f, down: f -> d;
* attention core: Q·Kᵀ and P·V over the unmasked half of the causal s×s scores, 2·s·h·e
  per token (4·s·h·e halved). This is megatron-LM's convention (``num_floating_point_operations``
  in its training.py: "causal mask (only half of the mask is non-zero)", backward = 2×
  forward), so our MFU compares with megatron's and with the perf model's (``perf/model.py``
  uses these functions; docs/design.md §10.13). :func:`rank_step_flops` instead counts what
  the kernels execute: the local and SDPA-math kernels compute the full s×s square.

Plus the LM head, 2·d·V per token (the embedding lookup is free). Training (forward + backward)
is 3× the forward count (backward = 2× forward: gradients w.r.t. inputs and weights).
Activation recompute is not counted (model FLOPs, not hardware FLOPs).
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_boost.config.shape import ModelShape, check_mode, config_mode
from megatron_boost.config.modes import TPMode
from megatron_boost.config.placement import Dim, Group, split_dims

__all__ = ["flops_per_token", "forward_flops_per_token", "step_flops", "rank_step_flops",
           "attention_core_flops", "MODEL_FLOPS_CAUSAL"]


def _mode_of(cfg: Any, mode: Optional[str]) -> TPMode:
    """The explicit mode, else the config's own (:func:`~megatron_boost.config.shape.
    config_mode`)."""
    return config_mode(cfg) if mode is None else check_mode(mode)


def attention_core_flops(seq_length: int, heads: int, head_dim: int,
                         causal: bool = False) -> float:
    """Forward FLOPs per token of Q·Kᵀ and P·V over ``heads`` heads: 2·2·s·h·e, halved with
    ``causal`` (only the unmasked half of the s×s scores)."""
    return 4.0 * seq_length * heads * head_dim * (0.5 if causal else 1.0)


#: Model FLOPs count the causal half of the attention scores (megatron-LM's convention).
MODEL_FLOPS_CAUSAL = True


def _layer_parts(shape: ModelShape, mode: str, seq_length: int,
                 causal: bool = MODEL_FLOPS_CAUSAL):
    """(projection FLOPs, attention-core FLOPs) per token of one layer, forward."""
    proj = sum(p.flops_per_token for p in shape.projections(mode))
    return proj, attention_core_flops(seq_length, shape.heads, shape.e, causal)


def _shape_and_sizes(cfg: Any, vocab_size: Optional[int], seq_length: Optional[int]):
    shape = cfg if isinstance(cfg, ModelShape) else ModelShape.from_config(cfg)
    V = int(vocab_size if vocab_size is not None else shape.vocab)
    s = int(seq_length if seq_length is not None else shape.seq_length)
    return shape, V, s


def forward_flops_per_token(cfg: Any, mode: Optional[str] = None, *,
                            vocab_size: Optional[int] = None,
                            seq_length: Optional[int] = None) -> float:
    """Forward-pass matmul FLOPs per token of the whole model (see the module doc).

    Args:
        cfg: a ``RunConfig``, its ``ModelConfig``, a ``(Boost)TransformerConfig`` or a
            :class:`~megatron_boost.config.shape.ModelShape`.
        mode: 'full' (dense projections), 'naive' or 'boost' (bottlenecks); default: the
            config's own mode.
        vocab_size: the LM head width (e.g. the padded vocabulary); default: the config's.
        seq_length: attention span s; default: the config's ``seq_length``.
    """
    mode = _mode_of(cfg, mode)
    shape, V, s = _shape_and_sizes(cfg, vocab_size, seq_length)
    proj, core = _layer_parts(shape, mode, s)
    return shape.num_layers * (proj + core) + 2.0 * shape.hidden * V


def flops_per_token(cfg: Any, mode: Optional[str] = None, **kwargs) -> float:
    """Training (forward + backward) model FLOPs per token: 3 × :func:`forward_flops_per_token`."""
    return 3.0 * forward_flops_per_token(cfg, mode, **kwargs)


def step_flops(cfg: Any, mode: str, tokens: int, vocab_size: int, seq_length: int) -> float:
    """Training (forward + backward = 3 × forward) model FLOPs of ``tokens`` tokens."""
    return 3.0 * tokens * forward_flops_per_token(cfg, mode, vocab_size=vocab_size,
                                                  seq_length=seq_length)


def rank_step_flops(cfg: Any, mode: str, tokens: int, vocab_size: int, seq_length: int,
                    tp: int) -> float:
    """Training matmul FLOPs one TP rank executes for ``tokens`` tokens (per pipeline stage
    summed over stages, i.e. the whole model divided only by TP).

    full / boost: everything split t ways. naive: projections and the vocab-parallel head split
    t ways, the attention core duplicated on every rank (it runs on the replicated heads,
    docs/design.md §2). The attention core is counted as the kernels run it, the full s×s
    square (model FLOPs count half of it). Recompute is not counted."""
    mode = check_mode(mode)
    shape, V, s = _shape_and_sizes(cfg, vocab_size, seq_length)
    proj, core = _layer_parts(shape, mode, s, causal=False)
    core = shape.num_layers * core
    split = shape.num_layers * proj + 2.0 * shape.hidden * V
    # the core is split where the heads are: qkv split along its output (not naive)
    heads_split = Dim.D_OUT in split_dims(mode, Group.QKV)
    per_token = split / tp + (core / tp if heads_split else core)
    return 3.0 * tokens * per_token
