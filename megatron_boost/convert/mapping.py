"""Parameter names and layouts between megatron-boost checkpoints and Hugging Face LLaMA/CoLA.

The megatron side is the set of *global* checkpoint tensors (the dist_checkpointing keys of
``docs/design.md §8``, layer index after ``@``), identical for every TP mode and layout; the
HF side is a LLaMA state dict (``LlamaForCausalLM``) or its CoLA variant (``ColaForCausalLM``,
per projection ``cola_a``: [in, r], ``cola_b``: [r, out], as in the public CoLA code, arXiv
2502.10940). Every function here is pure tensor bookkeeping (no process group, no model).

Bottleneck factors: megatron stores A: [r, in] and B: [out, r] (y = B·σ(A·x)); CoLA stores
their transposes (y = σ(x·cola_a)·cola_b), so cola_a = Aᵀ and cola_b = Bᵀ.
Full rank: megatron fuses q, k, v into one [ng·(np/ng + 2)·hn, d] weight whose rows are, per
query group, its np/ng query heads then its key head then its value head (``docs/design.md
§4``); gate and up are fused as [gate; up] (2f rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

import torch

__all__ = [
    "AttentionShape", "PROJECTIONS", "GLOBAL_NAMES", "NORM_NAMES", "megatron_to_hf",
    "hf_to_megatron", "fold_factors", "layer_key",
]

#: projection -> (megatron module under a decoder layer, HF module under model.layers.i).
PROJECTIONS = {
    "q": ("self_attention.linear_qkv", "self_attn.q_proj"),
    "k": ("self_attention.linear_qkv", "self_attn.k_proj"),
    "v": ("self_attention.linear_qkv", "self_attn.v_proj"),
    "o": ("self_attention.linear_proj", "self_attn.o_proj"),
    "gate": ("mlp.linear_fc1", "mlp.gate_proj"),
    "up": ("mlp.linear_fc1", "mlp.up_proj"),
    "down": ("mlp.linear_fc2", "mlp.down_proj"),
}
#: full-rank megatron weights: fused qkv and [gate; up], plain o and down.
_FULL_WEIGHTS = {"o": "self_attention.linear_proj.weight", "down": "mlp.linear_fc2.weight"}
_QKV_WEIGHT = "self_attention.linear_qkv.weight"
_FC1_WEIGHT = "mlp.linear_fc1.weight"
#: the fused-norm weights of a layer (same key in every mode) -> HF per-layer names.
NORM_NAMES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
}
#: tensors outside the decoder layers. A tied model (``share_embeddings_and_output_weights``;
#: HF ``tie_word_embeddings``) has no output_layer / lm_head tensor: the head reads the
#: embedding.
GLOBAL_NAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class AttentionShape:
    """Heads np, key/value groups ng and head dimension hn of the attention."""

    heads: int
    groups: int
    head_dim: int


def layer_key(layer: int, name: str) -> str:
    """The global megatron key of a per-layer tensor (layer index after '@')."""
    return f"decoder.layers.{name}@{layer}"


def _hf_layer(layer: int, name: str) -> str:
    return f"model.layers.{layer}.{name}"


def split_qkv(qkv: torch.Tensor, att: AttentionShape):
    """megatron's fused [ng·(np/ng + 2)·hn, d] -> q [np·hn, d], k, v [ng·hn, d]."""
    per_group = att.heads // att.groups
    grouped = qkv.view(att.groups, per_group + 2, att.head_dim, -1)  # [ng, np/ng+2, hn, d]
    q, k, v = grouped.split([per_group, 1, 1], dim=1)
    return (q.reshape(att.heads * att.head_dim, -1),  # [np·hn, d]
            k.reshape(att.groups * att.head_dim, -1),  # [ng·hn, d]
            v.reshape(att.groups * att.head_dim, -1))


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, att: AttentionShape):
    """Inverse of :func:`split_qkv`."""
    d = q.shape[-1]
    per_group = att.heads // att.groups
    q = q.view(att.groups, per_group, att.head_dim, d)  # [ng, np/ng, hn, d]
    k = k.view(att.groups, 1, att.head_dim, d)  # [ng, 1, hn, d]
    v = v.view(att.groups, 1, att.head_dim, d)
    return torch.cat([q, k, v], dim=1).reshape(-1, d)  # [ng·(np/ng+2)·hn, d]


def _num_layers(weights: Dict[str, torch.Tensor]) -> int:
    return 1 + max(int(k.rsplit("@", 1)[1]) for k in weights if "@" in k)


def _full_rank_layer(weights, layer: int, att: AttentionShape) -> Dict[str, torch.Tensor]:
    """The seven dense [out, in] weights of a full-rank layer, by projection."""
    q, k, v = split_qkv(weights[layer_key(layer, _QKV_WEIGHT)], att)
    gate, up = weights[layer_key(layer, _FC1_WEIGHT)].chunk(2, dim=0)  # [f, d] each
    dense = {"q": q, "k": k, "v": v, "gate": gate, "up": up}
    dense.update({p: weights[layer_key(layer, key)] for p, key in _FULL_WEIGHTS.items()})
    return dense


def fold_factors(weights, layer: int) -> Dict[str, torch.Tensor]:
    """W = B·A per projection of a low-rank layer: the dense weight of a σ = identity
    bottleneck (B·(A·x) = (B·A)·x)."""
    out = {}
    for proj, (module, _) in PROJECTIONS.items():
        a = weights[layer_key(layer, f"{module}.A_{proj}")]  # [r, in]
        b = weights[layer_key(layer, f"{module}.B_{proj}")]  # [out, r]
        out[proj] = b @ a  # [out, in]
    return out


def megatron_to_hf(weights: Dict[str, torch.Tensor], att: AttentionShape, lowrank: bool,
                   fold: bool = False) -> Dict[str, torch.Tensor]:
    """Global megatron tensors -> HF state dict: CoLA factors (``lowrank``), dense LLaMA
    weights folded from them (``fold``), or the full-rank model's own weights."""
    hf = {hf_name: weights[key] for key, hf_name in GLOBAL_NAMES.items() if key in weights}
    for layer in range(_num_layers(weights)):
        for key, hf_name in NORM_NAMES.items():
            hf[_hf_layer(layer, hf_name)] = weights[layer_key(layer, key)]
        if lowrank and not fold:
            for proj, (module, hf_module) in PROJECTIONS.items():
                name = _hf_layer(layer, hf_module)
                hf[f"{name}.cola_a"] = weights[layer_key(layer, f"{module}.A_{proj}")].t()
                hf[f"{name}.cola_b"] = weights[layer_key(layer, f"{module}.B_{proj}")].t()
            continue
        dense = fold_factors(weights, layer) if lowrank else _full_rank_layer(weights, layer,
                                                                               att)
        for proj, (_, hf_module) in PROJECTIONS.items():
            hf[f"{_hf_layer(layer, hf_module)}.weight"] = dense[proj]
    return {name: t.contiguous() for name, t in hf.items()}


def hf_to_megatron(hf: Dict[str, torch.Tensor], num_layers: int, att: AttentionShape,
                   factors=None) -> Dict[str, torch.Tensor]:
    """HF state dict -> global megatron tensors. ``factors(layer, proj, hf_module)`` returns
    (A [r, in], B [out, r]) for a low-rank target; None imports the dense weights as the
    full-rank model's. A tied source (no ``lm_head.weight``) gives no output_layer tensor;
    the model it is loaded into must then be tied as well (``set_weights`` names what is
    missing)."""
    weights = {key: hf[hf_name] for key, hf_name in GLOBAL_NAMES.items() if hf_name in hf}
    for layer in range(num_layers):
        for key, hf_name in NORM_NAMES.items():
            weights[layer_key(layer, key)] = hf[_hf_layer(layer, hf_name)]
        if factors is not None:
            for proj, (module, hf_module) in PROJECTIONS.items():
                a, b = factors(layer, proj, _hf_layer(layer, hf_module))
                weights[layer_key(layer, f"{module}.A_{proj}")] = a
                weights[layer_key(layer, f"{module}.B_{proj}")] = b
            continue
        dense = {p: hf[f"{_hf_layer(layer, m)}.weight"] for p, (_, m) in PROJECTIONS.items()}
        weights[layer_key(layer, _QKV_WEIGHT)] = fuse_qkv(dense["q"], dense["k"], dense["v"],
                                                          att)
        weights[layer_key(layer, _FC1_WEIGHT)] = torch.cat([dense["gate"], dense["up"]], 0)
        weights.update({layer_key(layer, key): dense[p] for p, key in _FULL_WEIGHTS.items()})
    return weights
