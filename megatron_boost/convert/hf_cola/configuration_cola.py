"""Configuration of a CoLA causal LM (arXiv 2502.10940) exported by megatron-boost.

Self-contained: this file is copied into every exported low-rank model directory and loaded by
``AutoConfig.from_pretrained(dir, trust_remote_code=True)``; it imports only transformers.

A CoLA model is a LLaMA decoder whose seven projections (q, k, v, o, gate, up, down) are each
y = B·σ(A·x) with rank ``attn_rank`` (attention) or ``mlp_rank`` (MLP) and σ = ``lr_act_type``.
The MLP is ``down(gate(x) * up(x))`` with ``only_lr_act`` (σ lives inside the bottlenecks
only), else ``down(act(gate(x)) * up(x))`` with act = ``mlp_gate_act`` (default
``hidden_act``). The keys mean the same to the CoLA authors' ``ColaForCausalLM``
(github.com/alvin-zyl/CoLA), which takes σ from ``hidden_act`` (equal to ``lr_act_type`` here),
its gate's activation from ``hidden_act`` unless ``only_lr_act``, and one ``rank``.
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
    only_lr_act: bool = True
    """No activation on the MLP's gate (CoLA's key): σ inside the bottlenecks only."""
    mlp_gate_act: str | None = None
    """The gate's activation when ``only_lr_act`` is false (None: ``hidden_act``, as CoLA's
    class takes it)."""
    rank: int | None = None
    """CoLA's one rank of every projection (when attn_rank == mlp_rank)."""

    def to_dict(self):
        """As LlamaConfig's, leaving ``rank`` and ``mlp_gate_act`` out when they are None
        (two ranks; no gate activation) rather than writing null."""
        out = super().to_dict()
        for key in ("rank", "mlp_gate_act"):
            if out.get(key, 0) is None:
                del out[key]
        return out
