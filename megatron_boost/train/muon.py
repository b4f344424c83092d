"""Muon for the low-rank factors: orthogonalised momentum on each projection's global matrix.

Muon (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural networks"; at scale:
Liu et al. 2025, arXiv 2502.16982) replaces a 2-D weight's update by its momentum pushed to the
nearest semi-orthogonal matrix with a quintic Newton-Schulz iteration. The matrix it is applied
to defines the optimizer: orthogonalising a TP shard, or several projections' factors stacked
in one parameter, gives a different update (and a different model at every TP size). Here the
update of every 2-D factor is computed on the projection's *global* matrix (docs/design.md §16):

- the grouped factors of a bottleneck group (A: boost [Σr, d/t], naive [Σr/t, d]; B: boost
  [Σ d_out/t, r], naive [Σ d_out, r/t]) are split into their projections' rows
  (``BottleneckGroup.factors``), each piece its own matrix;
- a TP-sharded matrix (``partition_dim`` of megatron's TP attributes) is all-gathered over the
  TP group, orthogonalised whole on every rank (the same arithmetic, so the same result), and
  this rank's slice is kept. Low-rank factors are small (r × d), so the gather is cheap and
  needs no distributed Newton-Schulz.

Embeddings, the output head and every 1-D weight (norm γ) stay on megatron's AdamW, as in
common practice (megatron's own Muon makes the same split).

megatron-core ships a Muon (``TensorParallelMuon``, ``get_megatron_muon_optimizer``), built on
the ``emerging-optimizers`` package. It is not used: that package needs Python >= 3.12 (the main
tier is 3.11), megatron-core 0.16's wrapper calls it with an argument it no longer takes, and its
only split of a fused parameter is attention's QKV by head group, not a bottleneck group's
projections. What *is* megatron's: the parameter groups (``compat.optimizer_param_groups``), the
fp32 / bf16-master wrappers with gradient clipping and checkpointing
(``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``, ``ChainedOptimizer``), AdamW for the
rest (``get_megatron_optimizer``) and the TP all-gather
(``gather_from_tensor_model_parallel_region``).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from megatron.core import parallel_state
from megatron.core.optimizer import ChainedOptimizer, get_megatron_optimizer
from megatron.core.optimizer.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
)
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from megatron_boost.compat import optimizer_param_groups
from megatron_boost.config.placement import placement
from megatron_boost.parallel.layers import BottleneckGroup

__all__ = ["NS_COEFFICIENTS", "SCALE_RULES", "newton_schulz", "update_scale", "BoostMuon",
           "muon_params", "build_muon_optimizer"]

#: Newton-Schulz coefficient sets (a, b, c) of X ← aX + (bA + cA²)X, A = XXᵀ, cycled over steps.
NS_COEFFICIENTS: Dict[str, Tuple[Tuple[float, float, float], ...]] = {
    # Jordan 2024: one quintic maximising the slope at zero (singular values land in ~[0.7, 1.2]).
    "jordan": ((3.4445, -4.7750, 2.0315),),
    # Per-step coefficients tuned for five steps (modded-nanogpt; as emerging-optimizers'
    # "quintic" set).
    "tuned5": ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377),
               (3.7418, -5.5913, 2.3037), (2.8769, -3.1427, 1.2046),
               (2.8366, -3.0525, 1.2012)),
}

#: Update scale of an orthogonalised [m, n] matrix (before ``optimizer.muon_extra_scale``).
SCALE_RULES = {
    # Liu et al. 2025: with extra scale 0.2 the update's RMS is 0.2, AdamW's typical RMS, so
    # one learning rate serves the Muon and the AdamW parameters.
    "spectral": lambda m, n: max(m, n) ** 0.5,
    "shape": lambda m, n: max(1.0, m / n) ** 0.5,  # Jordan 2024
    "unit_rms": lambda m, n: (m / n) ** 0.5,  # Bernstein 2025: unit RMS→RMS operator norm
}


def newton_schulz(g: torch.Tensor, coefficients: Sequence[Tuple[float, float, float]],
                  steps: int, eps: float = 1e-7) -> torch.Tensor:
    """The quintic Newton-Schulz iteration towards U·Vᵀ of ``g = U·S·Vᵀ`` ([m, n], fp32)."""
    x = g.float()
    transposed = x.shape[0] > x.shape[1]
    if transposed:  # iterate on the wide orientation: A = XXᵀ is the smaller Gram matrix
        x = x.t()
    x = x / (x.norm() + eps)  # spectral norm <= Frobenius norm <= 1: inside the basin
    for i in range(steps):
        a, b, c = coefficients[i % len(coefficients)]
        gram = x @ x.t()
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.t() if transposed else x


def update_scale(rows: int, cols: int, rule: str, extra: float) -> float:
    """The factor an orthogonalised [rows, cols] update is multiplied by."""
    return SCALE_RULES[rule](rows, cols) * extra


class BoostMuon(torch.optim.Optimizer):
    """Muon on 2-D parameters, each projection orthogonalised as its global matrix.

    Per parameter: decoupled weight decay ``p ← p·(1 − lr·wd)``; momentum
    ``m ← β·m + (1 − β)·g``; the update direction ``g + β·(m − g)`` (Nesterov) or ``m``; then
    its global orthogonalisation (see the module docstring), scaled, times ``lr``.

    Args:
        param_groups: megatron's parameter groups (``lr``, ``weight_decay`` set per step by the
            scheduler). They stay megatron's: its checkpoint loader matches groups by their
            multipliers, so a group per split would be confused on resume.
        factor_rows: ``id`` of a grouped factor (A or B) -> the global rows of its projections.
        tp_group: the group TP-sharded parameters (``partition_dim``) are sharded over.
    """

    def __init__(self, param_groups, *, factor_rows: Dict[int, Tuple[int, ...]], tp_group,
                 momentum: float, nesterov: bool, ns_steps: int, ns_coefficients: str,
                 scale_rule: str, extra_scale: float):
        super().__init__(param_groups, dict(lr=0.0, weight_decay=0.0))
        self.factor_rows = factor_rows
        self.tp_group = tp_group
        self.tp_size = torch.distributed.get_world_size(tp_group) if tp_group is not None else 1
        self.tp_rank = torch.distributed.get_rank(tp_group) if tp_group is not None else 0
        self.momentum, self.nesterov = momentum, nesterov
        self.ns_steps, self.coefficients = ns_steps, NS_COEFFICIENTS[ns_coefficients]
        self.scale_rule, self.extra_scale = scale_rule, extra_scale

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("BoostMuon takes no closure")
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                momentum = self.state[p].get("momentum_buffer")
                if momentum is None:
                    momentum = self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                grad = p.grad.to(p.dtype)
                momentum.lerp_(grad, 1 - self.momentum)
                direction = grad.lerp(momentum, self.momentum) if self.nesterov else momentum
                update = self.orthogonal_update(p, direction, self.factor_rows.get(id(p)))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.to(p.dtype), alpha=-group["lr"])

    def orthogonal_update(self, p: torch.Tensor, direction: torch.Tensor,
                          factor_rows: Optional[Sequence[int]]) -> torch.Tensor:
        """This rank's shard of the scaled, orthogonalised update of ``p``: each projection's
        rows (``factor_rows``) on their own, each as the global matrix."""
        axis = self._sharded_axis(p)
        if factor_rows is None:
            return self._orthogonalised_shard(direction, axis)
        local_rows = [r // self.tp_size if axis == 0 else r for r in factor_rows]
        pieces = direction.split(local_rows, dim=0)  # per projection: [r_p(/t), d(/t)]
        return torch.cat([self._orthogonalised_shard(piece, axis) for piece in pieces], dim=0)

    def _sharded_axis(self, p: torch.Tensor) -> Optional[int]:
        """The axis ``p`` is split along over the TP group (megatron's TP attributes), or None."""
        if self.tp_size == 1 or not getattr(p, "tensor_model_parallel", False):
            return None
        return p.partition_dim

    def _orthogonalised_shard(self, shard: torch.Tensor, axis: Optional[int]) -> torch.Tensor:
        whole = self._global_matrix(shard, axis)
        update = newton_schulz(whole, self.coefficients, self.ns_steps)
        update = update * update_scale(*whole.shape, self.scale_rule, self.extra_scale)
        return update if axis is None else update.chunk(self.tp_size, dim=axis)[self.tp_rank]


    def _global_matrix(self, shard: torch.Tensor, axis: Optional[int]) -> torch.Tensor:
        """The unsharded matrix of a TP shard, on every rank (identity when not sharded)."""
        if axis is None:
            return shard
        last = shard.movedim(axis, -1).contiguous()  # the sharded axis last, as megatron gathers
        return gather_from_tensor_model_parallel_region(last, self.tp_group).movedim(-1, axis)


def muon_params(ddp_chunks) -> List[torch.Tensor]:
    """Muon's parameters: the trainable 2-D ones outside the embedding and the output head
    (the rule of megatron's own Muon); the rest (embeddings, head, norm γ) go to AdamW. The
    embedding and head are found as the language model's ``embedding`` and ``output_layer``
    modules: naive and boost build their own, which megatron has not tagged
    ``is_embedding_or_output_parameter``."""
    ends = {id(p) for chunk in ddp_chunks for m in chunk.modules()
            if isinstance(m, LanguageModule)
            for name in ("embedding", "output_layer") if getattr(m, name, None) is not None
            for p in getattr(m, name).parameters()}
    return [p for chunk in ddp_chunks for p in chunk.parameters()
            if p.requires_grad and p.dim() == 2 and id(p) not in ends
            and not getattr(p, "is_embedding_or_output_parameter", False)]


def _global_factor_rows(ddp_chunks) -> Dict[int, Tuple[int, ...]]:
    """id of each grouped factor (A, B) -> its projections' global row counts, read through the
    layers' ``factors`` views and the placement table's split axis of the factor (naive's A
    and boost's B shard the rows). Global, so a checkpoint of any TP size resumes."""
    rows = {}
    for chunk in ddp_chunks:
        for module in chunk.modules():
            if not isinstance(module, BottleneckGroup):
                continue
            entry = placement(module.mode, module.group)
            for which, factor in (("A", entry.a), ("B", entry.b)):
                scale = module.tp_size if factor.split == 0 else 1  # rows split t ways
                rows[id(getattr(module, which))] = tuple(f.shape[0] * scale
                                                        for f in module.factors(which))
    return rows


def _main_param_rows(wrapped, rows: Dict[int, Tuple[int, ...]]) -> Dict[int, Tuple[int, ...]]:
    """``rows`` keyed by the optimizer's parameters: megatron's bf16 wrapper steps fp32 main
    copies of the bf16 parameters (its ``float16_groups`` and ``fp32_from_float16_groups`` are
    aligned)."""
    out = dict(rows)
    for model_group, main_group in zip(getattr(wrapped, "float16_groups", []),
                                       getattr(wrapped, "fp32_from_float16_groups", [])):
        for model_param, main_param in zip(model_group, main_group):
            if id(model_param) in rows:
                out[id(main_param)] = rows[id(model_param)]
    return out


def _init_momentum(opt, config=None):
    """State for a checkpoint written before the first step (megatron's init_state_fn)."""
    for group in opt.param_groups:
        for p in group["params"]:
            if "momentum_buffer" not in opt.state[p]:
                opt.state[p]["momentum_buffer"] = torch.zeros_like(p.data)


def build_muon_optimizer(opt_config, ddp_chunks, settings, tp_group=None) -> ChainedOptimizer:
    """Muon for the 2-D factors and weights, megatron's AdamW for the rest, chained.

    Args:
        opt_config: megatron's OptimizerConfig (lr, weight decay, clipping, bf16, Adam's
            settings); its clipping runs over both optimizers' gradients together.
        settings: the run's ``OptimizerConfig`` section (``muon_*`` fields).
        tp_group: the TP group (default: megatron's).
    """
    if tp_group is None:
        tp_group = parallel_state.get_tensor_model_parallel_group()
    muon = muon_params(ddp_chunks)
    chosen = {id(p) for p in muon}
    others = [p for chunk in ddp_chunks for p in chunk.parameters()
              if p.requires_grad and id(p) not in chosen]
    with _frozen(others):
        groups = optimizer_param_groups(ddp_chunks, opt_config)
    rows = _global_factor_rows(ddp_chunks)
    optimizer = BoostMuon(groups, factor_rows=rows, tp_group=tp_group,
                          momentum=settings.muon_momentum, nesterov=settings.muon_nesterov,
                          ns_steps=settings.muon_ns_steps,
                          ns_coefficients=settings.muon_ns_coefficients,
                          scale_rule=settings.muon_scale, extra_scale=settings.muon_extra_scale)
    wrapped = (Float16OptimizerWithFloat16Params(optimizer, opt_config, None, _init_momentum)
               if opt_config.bf16 else FP32Optimizer(optimizer, opt_config, _init_momentum))
    optimizer.factor_rows = _main_param_rows(wrapped, rows)
    with _frozen(muon):
        adam = get_megatron_optimizer(opt_config, ddp_chunks)
    return ChainedOptimizer([wrapped] + list(getattr(adam, "chained_optimizers", [adam])))


class _frozen:
    """Parameters hidden from megatron's group builders (``requires_grad`` off) for a while:
    how megatron's own Muon gives each optimizer its parameters."""

    def __init__(self, params):
        self.params = params

    def __enter__(self):
        for p in self.params:
            p.requires_grad_(False)

    def __exit__(self, *exc):
        for p in self.params:
            p.requires_grad_(True)
