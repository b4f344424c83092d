"""Bottleneck model configuration: the bottleneck activations and ``BoostTransformerConfig``,
megatron-core's TransformerConfig extended with the low-rank settings (the mode enum and the
size rules it checks are in ``megatron_boost/config/modes.py``).

The layers receive this object as Megatron's ``config=`` argument (through ``build_module``), so
every setting they need travels explicitly with the config; nothing is read from globals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from megatron_boost.config.modes import (TPMode, check_bottleneck_ranks, check_lowrank_recompute,
                                          check_tp_split)

__all__ = [
    "BoostTransformerConfig",
    "BOTTLENECK_ACTIVATIONS",
    "BOTTLENECK_ACTIVATION_GRADS",
    "register_bottleneck_activation",
    "get_bottleneck_activation",
    "get_bottleneck_activation_grad",
    "is_identity",
]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _identity_grad(dz: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return dz


def _silu_grad(dz: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.silu_backward(dz, y)  # autograd's own kernel for F.silu


def _gelu_grad(dz: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.gelu_backward(dz, y)  # autograd's own kernel for F.gelu


def _relu_grad(dz: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten.threshold_backward(dz, y, 0)  # relu'(y) = [y > 0], as autograd's


BOTTLENECK_ACTIVATIONS: Dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,  # CoLA (arXiv 2502.10940)
    "identity": _identity,  # vanilla low-rank factorisation
    "gelu": F.gelu,
    "relu": F.relu,
}
#: σ'(y)·dz of each activation, as autograd computes it: the layers' fused regions
#: (``parallel/online_rmsnorm.py``) recompute σ in backward instead of saving its output.
BOTTLENECK_ACTIVATION_GRADS: Dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "silu": _silu_grad, "identity": _identity_grad, "gelu": _gelu_grad, "relu": _relu_grad,
}


def register_bottleneck_activation(name: str, fn: Callable[[torch.Tensor], torch.Tensor],
                                   grad: Optional[Callable] = None):
    """Make ``fn`` (elementwise) available as ``bottleneck_activation: <name>``.

    The parallel layers apply the activation to replicated (boost) or rank-local slices (naive)
    of the bottleneck, so any elementwise function is valid in every mode. ``grad(dz, y)``,
    σ'(y)·dz, lets the layers' fused regions compute the backward in the same kernel (on CUDA);
    without it, autograd differentiates ``fn`` there.
    """
    BOTTLENECK_ACTIVATIONS[name] = fn
    BOTTLENECK_ACTIVATION_GRADS.pop(name, None)
    if grad is not None:
        BOTTLENECK_ACTIVATION_GRADS[name] = grad


def get_bottleneck_activation_grad(name: str) -> Optional[Callable]:
    """σ'(y)·dz of a registered activation, or None (autograd differentiates it)."""
    get_bottleneck_activation(name)
    return BOTTLENECK_ACTIVATION_GRADS.get(name)


def is_identity(name: str) -> bool:
    """Whether the activation is the identity (no kernel to run)."""
    return get_bottleneck_activation(name) is _identity


def get_bottleneck_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in BOTTLENECK_ACTIVATIONS:
        raise ValueError(
            f"bottleneck_activation ({name!r}) is unknown; choose one of "
            f"{sorted(BOTTLENECK_ACTIVATIONS)} or register one with "
            f"megatron_boost.config.transformer.register_bottleneck_activation")
    return BOTTLENECK_ACTIVATIONS[name]


@dataclass
class BoostTransformerConfig(TransformerConfig):
    """megatron-core TransformerConfig plus the bottleneck (low-rank) settings."""

    tp_mode: TPMode = TPMode.BOOST
    """Tensor-parallel mode: full (full-rank model), naive or boost (bottleneck model)."""

    attn_rank: Optional[int] = None
    """Rank r of the q, k, v and o bottlenecks. Required in naive and boost modes."""

    mlp_rank: Optional[int] = None
    """Rank r of the gate, up and down bottlenecks. Required in naive and boost modes."""

    bottleneck_activation: str = "silu"
    """Activation σ inside every bottleneck, y = B·σ(A·x): 'silu' (CoLA), 'identity'
    (vanilla low-rank), or any registered name."""

    mlp_gate_activation: bool = False
    """Apply SiLU to the gate branch of the MLP as well (SwiGLU on top of the bottlenecks, as
    CoLA's 60M/130M configs do). False: the activation lives only inside the bottlenecks."""

    cola_init: bool = True
    """Initialise both bottleneck factors with CoLA's randn · r^(-1/4) · (d_in + d_out)^(-1/4).
    False: Megatron's init_method for A and output_layer_init_method for B."""

    bottleneck_grad_accumulation_fusion: bool = True
    """megatron's ``gradient_accumulation_fusion`` contract for the bottleneck factors: their
    weight-gradient GEMMs accumulate into the ``main_grad`` megatron's DDP gives them and set
    ``grad_added_to_main_grad``, so DDP's hook adds nothing (``parallel/wgrad.py``; where torch
    has no GEMM from the operands' dtype into main_grad's, the gradient goes through the hook).
    megatron's own ``gradient_accumulation_fusion`` (its linears, apex's kernel) is apart."""
    overlap_bottleneck_grad_reduce: bool = True
    """Overlap the backward all-reduce of each input gradient with the weight-gradient GEMMs
    (boost: dz of the B factors, Σr wide; naive: dx of the A factors, megatron's async
    column-parallel reduction). Gradients are identical either way."""

    bottleneck_overlap_chunks: int = 1
    """boost: blocks of the sequence over which each bottleneck group runs as one pipeline of
    GEMMs and all-reduces, forward and backward (``parallel.bottleneck_overlap_chunks``,
    ``parallel/pipeline.py``); 1: one of each."""

    interleave_halves: bool = False
    """boost: each layer's forward as two interleaved halves of the micro-batch
    (``parallel.interleave_halves``, ``parallel/interleave.py``)."""

    lowrank_recompute: bool = False
    """Low-rank activation checkpointing (BOOST): per layer keep only the hidden-sharded input,
    the all-reduced bottleneck activations and the rms sums of squares; recompute the rest in
    backward without re-running any collective. naive and boost modes."""

    share_embeddings_and_output_weights: bool = False
    """One [V, d] table for the input embedding and the output layer (the model's constructor
    argument of megatron's GPTModel, carried here so every builder sees it)."""

    attention_backend: str = "local"
    """Core attention of every layer: sdpa (torch scaled_dot_product_attention), local
    (megatron's DotProductAttention) or te (Transformer Engine). Runs take it from
    ``model.attention_backend``, resolved for the process by ``config.resolved.resolve_run``."""

    def __post_init__(self):
        self.tp_mode = TPMode.parse(self.tp_mode)
        if self.attention_backend not in ("sdpa", "local", "te"):
            raise ValueError(f"attention_backend ({self.attention_backend!r}) must be one of "
                             f"sdpa, local, te (resolve 'auto' with runtime.backends first)")
        check_lowrank_recompute(self.tp_mode, self.lowrank_recompute)
        if self.tp_mode.is_lowrank:
            self._check_bottlenecks()
        self._check_tp_split()
        if self.tp_mode.is_lowrank:
            # CoLA's MLP: gate(x) ⊙ up(x) with the non-linearity inside the bottlenecks only,
            # unless the extra gate SiLU is asked for.
            self.gated_linear_unit = True
            self.activation_func = F.silu if self.mlp_gate_activation else _identity
            self.bias_activation_fusion = False
        super().__post_init__()

    def _check_bottlenecks(self) -> None:
        """The activation and both ranks of the bottleneck model (naive and boost modes)."""
        get_bottleneck_activation(self.bottleneck_activation)
        check_bottleneck_ranks(self.tp_mode, self.hidden_size, attn_rank=self.attn_rank,
                               mlp_rank=self.mlp_rank)

    def _check_tp_split(self) -> None:
        """Every dimension the mode shards must divide by the tensor-parallel size."""
        check_tp_split(self.tp_mode, self.tensor_model_parallel_size,
                       hidden_size=self.hidden_size, ffn_hidden_size=self.ffn_hidden_size,
                       num_attention_heads=self.num_attention_heads,
                       num_query_groups=self.num_query_groups, attn_rank=self.attn_rank,
                       mlp_rank=self.mlp_rank)
