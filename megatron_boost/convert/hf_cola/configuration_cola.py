"""Configuration of a CoLA causal LM (arXiv 2502.10940) exported by megatron-boost.

Self-contained: this file is copied into every exported low-rank model directory and loaded by
``AutoConfig.from_pretrained(dir, trust_remote_code=True)``; it imports only transformers.

A CoLA model is a LLaMA decoder whose seven projections (q, k, v, o, gate, up, down) are each
y = B·σ(A·x) with rank ``attn_rank`` (attention) or ``mlp_rank`` (MLP) and σ = ``lr_act_type``.
The MLP is ``down(act(gate(x)) * up(x))`` with ``hidden_act`` "linear" (no extra gate
non-linearity, σ lives inside the bottlenecks) or "silu" (the extra gate SiLU).
"""

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig


@strict
class ColaConfig(LlamaConfig):
    model_type = "cola"

    attn_rank: int = 64
    """Rank of the q, k, v, o bottlenecks."""
    mlp_rank: int = 64
    """Rank of the gate, up, down bottlenecks."""
    lr_act_type: str = "silu"
    """σ between the factors, a transformers ACT2FN name ("linear" is the identity)."""
