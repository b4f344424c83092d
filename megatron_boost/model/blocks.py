"""megatron's SelfAttention and MLP for the bottleneck modes: each takes its column group's
per-projection outputs as they are, instead of megatron's fused layouts (docs/design.md §4).

megatron's ``linear_qkv`` returns one tensor in a per-query-group layout that SelfAttention
splits into q, k, v, and ``linear_fc1`` one [gate; up] tensor that the MLP chunks. A bottleneck
group computes each projection with its own B factor, so producing those layouts would cost a
concatenation forward and its split backward, and the MLP adds a copy of its own (megatron's
``x_linear + glu_linear_offset``). Here the groups return (q, k, v) and (gate, up)
(``parallel/layers.py``):

* :class:`BottleneckSelfAttention` overrides only ``get_query_key_value_tensors``: q, k, v are
  viewed as heads ([s, b, heads, hn], no copy); RoPE, core attention and the output
  projection are megatron's;
* :class:`BottleneckMLP` overrides only ``forward``: gate ⊙ up (SiLU on the gate with
  ``mlp_gate_activation``) in one fused region forward and one backward
  (``parallel/fusion.py``), then ``linear_fc2``.

Parameters, checkpoint keys and everything else are megatron's own.
"""

from __future__ import annotations

from typing import Callable, Tuple

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP

from megatron_boost.config.transformer import get_bottleneck_activation_grad
from megatron_boost.parallel.fusion import fused_region

__all__ = ["BottleneckSelfAttention", "BottleneckMLP", "gated_product"]


class BottleneckSelfAttention(SelfAttention):
    """megatron's SelfAttention over a bottleneck ``linear_qkv`` returning (q, k, v)."""

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    output_gate=False, split_qkv=True):
        if key_value_states is not None or output_gate or not split_qkv:
            raise ValueError("BottleneckSelfAttention: self-attention only, without an output "
                             "gate or megatron's unsplit fused qkv (fused_single_qkv_rope)")
        (query, key, value), _ = self.linear_qkv(hidden_states)
        hn = self.hidden_size_per_attention_head
        # [s, b, np/t·hn] -> [s, b, np/t, hn]; key, value [s, b, ng/t·hn] -> [s, b, ng/t, hn]
        return tuple(t.view(*t.shape[:2], -1, hn) for t in (query, key, value))


@fused_region
def _gated(gate: torch.Tensor, up: torch.Tensor, gate_act: Callable) -> torch.Tensor:
    return gate_act(gate) * up


@fused_region
def _gated_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    gate_act: Callable, gate_act_grad: Callable
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    # autograd's products through act(gate) * up, in its order
    return gate_act_grad(grad * up, gate), grad * gate_act(gate)


def _identity(x):
    return x


class _GatedProduct(torch.autograd.Function):
    """h = act(gate) ⊙ up. fwd: one region; bwd: d_gate and d_up in one region. Saves gate
    and up (what the product's gradient needs)."""

    @staticmethod
    def forward(ctx, gate, up, silu_gate: bool):
        ctx.silu_gate = silu_gate
        ctx.save_for_backward(gate, up)
        return _gated(gate, up, F.silu if silu_gate else _identity)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        name = "silu" if ctx.silu_gate else "identity"
        return (*_gated_backward(grad, gate, up, F.silu if ctx.silu_gate else _identity,
                                 get_bottleneck_activation_grad(name)), None)


def gated_product(gate: torch.Tensor, up: torch.Tensor, silu_gate: bool) -> torch.Tensor:
    """SiLU(gate) ⊙ up, or gate ⊙ up: the bottleneck MLP's product ([s, b, f/t] each)."""
    return _GatedProduct.apply(gate, up, silu_gate)


class BottleneckMLP(MLP):
    """megatron's MLP over a bottleneck ``linear_fc1`` returning (gate, up)."""

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None:
            raise ValueError("BottleneckMLP: per_token_scale is for megatron's MoE experts")
        (gate, up), _ = self.linear_fc1(hidden_states)
        return self.linear_fc2(gated_product(gate, up, self.config.mlp_gate_activation))
