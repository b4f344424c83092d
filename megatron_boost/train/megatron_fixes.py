"""Workarounds for megatron-core's distributed-optimizer reload (docs/design.md §10.5).

With torch's Adam/AdamW (no apex/TE), reloading a ``fully_reshardable`` distributed-optimizer
checkpoint has three defects; each is handled here without editing megatron, and only on the
megatron-core versions that have it (:func:`megatron_boost.compat.optimizer_reload_defects`
says which: all three on 0.16 to 0.19):

1. ``init_state``: the optimizer state must exist, with a ``step``, before
   ``sharded_state_dict(is_loading=True)`` (:func:`_init_optimizer_state`: zero moments and a
   step per parameter, no dummy update);
2. ``step_on_copy``: ``KeyError: 'step'`` when the loaded tensors are copied
   (:func:`_keep_step_on_copy`, an instance-level wrapper);
3. ``shared_step``: ONE ``step`` tensor shared by all parameters after the load, which Adam
   would increment once per parameter (:func:`_unshare_optimizer_steps`).

``step`` is torch Adam's per-parameter counter. Transformer Engine's and apex's FusedAdam keep
the step in the param groups, and TE's maps every state key to a dtype and fails on one it
does not know: the workarounds touch torch's Adam/AdamW only (:func:`_torch_adams`) and leave
any other optimizer as megatron built it.
"""

from __future__ import annotations

import torch

from megatron_boost.compat import optimizer_reload_defects

__all__ = ["prepare_optimizer_load", "finish_optimizer_load", "inner_torch_optimizers"]


def prepare_optimizer_load(optimizer, use_distributed_optimizer: bool) -> None:
    """Before ``optimizer.sharded_state_dict(is_loading=True)``: defects 1 and 2."""
    defects = optimizer_reload_defects()
    if "init_state" in defects:
        _init_optimizer_state(optimizer)
    if use_distributed_optimizer and "step_on_copy" in defects:
        _keep_step_on_copy(optimizer)


def finish_optimizer_load(optimizer) -> None:
    """After ``optimizer.load_state_dict``: defect 3."""
    if "shared_step" in optimizer_reload_defects():
        _unshare_optimizer_steps(optimizer)


def _chain(optimizer) -> list:
    """The megatron optimizers of a (possibly chained) megatron optimizer."""
    return getattr(optimizer, "chained_optimizers", None) or [optimizer]


def inner_torch_optimizers(optimizer) -> list:
    """The torch.optim optimizers inside a megatron (Chained/Distributed/...) optimizer."""
    return [o.optimizer for o in _chain(optimizer) if getattr(o, "optimizer", None) is not None]


def _torch_adams(optimizer) -> list:
    """The inner optimizers that are torch's Adam or AdamW (AdamW derives from Adam)."""
    return [o for o in inner_torch_optimizers(optimizer) if isinstance(o, torch.optim.Adam)]


def _init_optimizer_state(optimizer) -> None:
    """Create Adam state (zero moments, step 0, one step tensor per parameter) where none
    exists, as a real step would, without changing any parameter."""
    for opt in _torch_adams(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p.data)
                if "exp_avg_sq" not in state:
                    state["exp_avg_sq"] = torch.zeros_like(p.data)
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)


def _unshare_optimizer_steps(optimizer) -> None:
    """Give every parameter's Adam state its own ``step`` tensor: torch's Adam increments
    ``step`` in place per parameter, so a shared one would advance by the number of
    parameters per iteration and the bias correction (hence every update) would be wrong."""
    for opt in _torch_adams(optimizer):
        for state in opt.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                state["step"] = step.detach().clone()


def _keep_step_on_copy(optimizer) -> None:
    """megatron's DistributedOptimizer copies the loaded tensors over *every* key of the
    parameter's optimizer state, ``step`` included, but the fully_reshardable checkpoint holds
    only param/exp_avg/exp_avg_sq. The step is restored separately (from the param groups), so
    hand the current one through."""
    for opt in _chain(optimizer):
        fn = getattr(opt, "_set_main_param_and_optimizer_states", None)
        inner = getattr(opt, "optimizer", None)
        if fn is None or getattr(fn, "_mboost_patched", False):
            continue
        if not isinstance(inner, torch.optim.Adam):
            continue  # only torch's Adam keeps a per-parameter step

        def with_step(model_param, tensors, _fn=fn, _opt=opt):
            if "step" not in tensors:
                group_index, group_order = _opt.model_param_group_index_map[model_param]
                main_param = _opt.optimizer.param_groups[group_index]["params"][group_order]
                state = _opt.optimizer.state[main_param]
                if "step" in state:
                    tensors = {**tensors, "step": state["step"]}
            return _fn(model_param, tensors)

        with_step._mboost_patched = True
        opt._set_main_param_and_optimizer_states = with_step
