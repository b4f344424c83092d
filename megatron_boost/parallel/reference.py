"""BOOST's decoder layer in plain torch: the version to read first (docs/design.md §14).

One boost decoder layer on one of t tensor-parallel ranks, picotron-style: each projection's
GEMMs one by one, no fusion, no overlap, no recompute, no pipeline. The residual stream comes
in and goes out as this rank's hidden shard [s, b, d/t]. The only communication is the three
collectives of the BOOST paper's figure, as plain ``torch.distributed`` calls:

1. :class:`AllReduceForward`: each group's rank-partial bottleneck products [s, b, Σr] are
   summed (the online RMSNorm's statistic Σx² riding as one more column); backward: identity;
2. :class:`AllReduceBackward`: forward identity; backward, the gradient dz of the bottleneck
   activation z is summed (each rank's B rows see only their part of it);
3. :class:`GatherHidden`: the hidden shards gathered in front of the final norm; backward:
   this rank's slice.

Every split axis comes from the placement table (``config/placement.py``). The optimised layer
(``parallel/layers.py``, ``parallel/mappings.py``) computes the same function, which
``tests/test_reference_layer.py`` checks at TP=2. fp32: the statistic rides in the products'
dtype here (the optimised layer gives it an fp32 all-reduce of its own under bf16).
"""

from __future__ import annotations

from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_boost.config.modes import TPMode
from megatron_boost.config.placement import (GROUP_PROJECTIONS, Group, Norm, Tensor, placement,
                                             split_shape, tensor_local_shape, tensor_split)

__all__ = ["AllReduceForward", "AllReduceBackward", "GatherHidden", "ReferenceGroup",
           "ReferenceBoostLayer", "ReferenceFinalNorm"]

BOOST = TPMode.BOOST


class AllReduceForward(torch.autograd.Function):
    """fwd: sum over the TP group; bwd: identity (every rank holds the same sum)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class AllReduceBackward(torch.autograd.Function):
    """fwd: identity; bwd: sum of the gradient over the TP group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class GatherHidden(torch.autograd.Function):
    """fwd: all-gather of the shards along ``dim``; bwd: this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx, grad):
        t, k = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(t, dim=ctx.dim)[k].contiguous(), None, None


class ReferenceGroup(torch.nn.Module):
    """One projection group, y_p = B_p·σ(A_p·norm(x)) for each projection p of the group
    (q, k, v; o; gate, up; down), with this rank's A_p [r, d_in/t] and B_p [d_out_p/t, r]
    (boost's splits in the table); γ [d_in/t] where the table fuses the norm into the group."""

    def __init__(self, group: Group, d_in: int, d_out: Dict[str, int], rank: int, tp_group,
                 sigma: Callable, eps: float):
        super().__init__()
        entry, t = placement(BOOST, group), dist.get_world_size(tp_group)
        self.tp_group, self.d_in, self.rank, self.sigma, self.eps = tp_group, d_in, rank, sigma, eps
        names = GROUP_PROJECTIONS[group]

        def factor(rows, cols, split):
            return torch.nn.Parameter(torch.empty(split_shape((rows, cols), split, t)))

        # A_p, B_p in the table's projection order (q, k, v; gate, up)
        self.A = torch.nn.ParameterList([factor(rank, d_in, entry.a.split) for p in names])
        self.B = torch.nn.ParameterList([factor(d_out[p], rank, entry.b.split) for p in names])
        self.gamma = None
        if entry.norm is Norm.FUSED:
            gamma_shape = tensor_local_shape(BOOST, Tensor.NORM_WEIGHT, (d_in,), t)
            self.gamma = torch.nn.Parameter(torch.ones(gamma_shape))

    def forward(self, x: torch.Tensor) -> List[torch.Tensor]:
        """x: [s, b, d_in/t], this rank's shard -> [s, b, d_out_p/t] per projection."""
        x_in = x if self.gamma is None else x * self.gamma  # γ ⊙ x, this rank's slice of it
        parts = [x_in @ a.t() for a in self.A]  # [s, b, r] each, this rank's share
        if self.gamma is not None:  # online RMSNorm: this rank's Σ x_k², [s, b, 1]
            parts.append(x.pow(2).sum(dim=-1, keepdim=True))
        summed = AllReduceForward.apply(torch.cat(parts, dim=-1), self.tp_group)  # collective 1
        n = self.rank * len(self.A)
        products = summed[..., :n]  # [s, b, Σr], complete on every rank
        if self.gamma is not None:  # A·(γ ⊙ x)/rms(x): 1/rms from the whole d's statistic
            products = products * torch.rsqrt(summed[..., n:] / self.d_in + self.eps)
        z = AllReduceBackward.apply(self.sigma(products), self.tp_group)  # collective 2 (bwd)
        return [zp @ b.t() for zp, b in zip(z.split(self.rank, dim=-1), self.B)]


class ReferenceBoostLayer(torch.nn.Module):
    """A boost decoder layer: x + o(attention(qkv(x))), then h + down(gate ⊙ up) (σ on the gate
    with ``silu_gate``), causal attention on this rank's heads, no RoPE, no dropout."""

    def __init__(self, *, hidden_size: int, num_heads: int, num_query_groups: int,
                 kv_channels: int, ffn_hidden_size: int, attn_rank: int, mlp_rank: int,
                 tp_group, sigma: Callable = F.silu, silu_gate: bool = False,
                 eps: float = 1e-5):
        super().__init__()
        d, hn, common = hidden_size, kv_channels, dict(tp_group=tp_group, sigma=sigma, eps=eps)
        self.head_dim, self.silu_gate = hn, silu_gate
        self.qkv = ReferenceGroup(Group.QKV, d, {"q": num_heads * hn, "k": num_query_groups * hn,
                                                 "v": num_query_groups * hn}, attn_rank, **common)
        self.proj = ReferenceGroup(Group.PROJ, num_heads * hn, {"o": d}, attn_rank, **common)
        self.fc1 = ReferenceGroup(Group.FC1, d, {"gate": ffn_hidden_size, "up": ffn_hidden_size},
                                  mlp_rank, **common)
        self.fc2 = ReferenceGroup(Group.FC2, ffn_hidden_size, {"down": d}, mlp_rank, **common)

    def attention(self, q, k, v) -> torch.Tensor:
        """Causal attention of this rank's heads, [s, b, heads/t·hn] in and out: no
        communication (the qkv group's output is head-sharded)."""
        # [s, b, heads/t·hn] -> [b, heads/t, s, hn]
        q, k, v = (y.view(*y.shape[:2], -1, self.head_dim).permute(1, 2, 0, 3)
                   for y in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.permute(2, 0, 1, 3).flatten(2)  # [s, b, heads/t·hn]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [s, b, d/t], this rank's hidden shard of the residual stream (the table's
        STREAM split); the same shard out."""
        h = x + self.proj(self.attention(*self.qkv(x)))[0]
        gate, up = self.fc1(h)
        return h + self.fc2((F.silu(gate) if self.silu_gate else gate) * up)[0]


class ReferenceFinalNorm(torch.nn.Module):
    """The final norm: the hidden shards gathered (collective 3), then RMSNorm with the
    replicated γ [d] (FINAL_NORM_WEIGHT in the table)."""

    def __init__(self, hidden_size: int, tp_group, eps: float = 1e-5):
        super().__init__()
        t = dist.get_world_size(tp_group)
        shape = tensor_local_shape(BOOST, Tensor.FINAL_NORM_WEIGHT, (hidden_size,), t)
        self.weight = torch.nn.Parameter(torch.ones(shape))
        self.tp_group, self.eps = tp_group, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [s, b, d/t] -> [s, b, d], the same on every rank."""
        full = GatherHidden.apply(x, self.tp_group, tensor_split(BOOST, Tensor.STREAM))
        return F.rms_norm(full, (full.shape[-1],), self.weight, self.eps)
