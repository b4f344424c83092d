"""CoLA causal LM for transformers 5.x (arXiv 2502.10940), exported by megatron-boost.

Self-contained: this file is copied into every exported low-rank model directory and loaded by
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)``; it imports only torch
and transformers. The decoder is transformers' LLaMA (attention, RoPE, RMSNorm, KV cache through
the Cache API, generation) with every projection replaced by a :class:`ColaLinear`.
"""

import torch
from torch import nn
from transformers import LlamaForCausalLM
from transformers.activations import ACT2FN

from .configuration_cola import ColaConfig

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class ColaLinear(nn.Module):
    """y = σ(x·A)·B with ``cola_a``: [in, r] and ``cola_b``: [r, out] (no bias)."""

    def __init__(self, in_features: int, out_features: int, rank: int, lr_act_type: str):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.lr_act = ACT2FN[lr_act_type]
        # CoLA's init, randn · r^(-1/4) · (in + out)^(-1/4); overwritten when weights load.
        scale = rank ** -0.25 * (in_features + out_features) ** -0.25
        self.cola_a = nn.Parameter(torch.randn(in_features, rank) * scale)
        self.cola_b = nn.Parameter(torch.randn(rank, out_features) * scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lr_act(x @ self.cola_a) @ self.cola_b  # [..., in] -> [..., r] -> [..., out]


def _replace_projections(parent: nn.Module, names, rank: int, lr_act_type: str) -> None:
    for name in names:
        dense = getattr(parent, name)
        setattr(parent, name, ColaLinear(dense.in_features, dense.out_features, rank,
                                         lr_act_type))


class ColaForCausalLM(LlamaForCausalLM):
    """LLaMA with CoLA bottlenecks in every projection; embeddings and head stay dense."""

    config_class = ColaConfig

    def __init__(self, config: ColaConfig):
        super().__init__(config)
        for layer in self.model.layers:
            _replace_projections(layer.self_attn, ATTENTION_PROJECTIONS, config.attn_rank,
                                 config.lr_act_type)
            _replace_projections(layer.mlp, MLP_PROJECTIONS, config.mlp_rank,
                                 config.lr_act_type)
            # LLaMA's MLP applies act_fn to the gate: none with only_lr_act, as CoLA's class
            layer.mlp.act_fn = (nn.Identity() if config.only_lr_act
                                else ACT2FN[config.mlp_gate_act or config.hidden_act])
        self.post_init()
