"""DDP's gradient accumulation in the op ledger (``measure/ledger.py``, docs/design.md §17).

megatron's ``DistributedDataParallel`` gives every parameter an fp32 ``main_grad`` and, after
autograd accumulates the parameter's gradient, runs a hook that adds it there
(``main_grad.add_(grad)``: one kernel reading the fp32 buffer and the gradient, writing the
buffer) unless the layer has already accumulated into ``main_grad`` itself and says so with
``grad_added_to_main_grad`` (megatron's linears with ``gradient_accumulation_fusion``: apex's
wgrad GEMM accumulates in place). The ledger builds no DDP, so while it records it gives each
parameter what DDP gives it, and a hook with DDP's rule, so the count follows the layer's code:
a layer whose GEMMs accumulate into ``main_grad`` adds nothing."""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["DDP_SCOPE", "ddp_grad_accumulation"]

#: The scope of the ledger's entries that DDP's hook issues.
DDP_SCOPE = "ddp.main_grad"


@contextlib.contextmanager
def ddp_grad_accumulation(layer, scopes) -> Iterator[None]:
    """While the block runs: every parameter of ``layer`` with an fp32 ``main_grad`` and
    ``grad_added_to_main_grad = False`` (as megatron's DDP sets them before each step), and a
    post-accumulate-grad hook applying DDP's rule (``distributed_data_parallel.py``'s
    ``_make_backward_post_hook``: add the gradient into ``main_grad`` unless
    ``grad_added_to_main_grad``, then drop it), its kernel scoped :data:`DDP_SCOPE`. ``layer``:
    any module; ``scopes``: what has a ``backward_scope`` (the ledger's ``Scopes``)."""
    def added_by_layer(param) -> bool:
        # A layer that saved its weight for backward sets the flag on the tensor that
        # ctx.saved_tensors hands it, which under the ledger's saved-tensor hooks
        # (measure/memory.py) is another Python object than the parameter; its in-place
        # accumulation into the shared main_grad shows on main_grad's version counter.
        return param.grad_added_to_main_grad or param.main_grad._version != versions[param]

    def hook(param) -> None:
        if param.grad is not None and not added_by_layer(param):
            outer, scopes.backward_scope = scopes.backward_scope, DDP_SCOPE
            try:
                param.main_grad.add_(param.grad)
            finally:
                scopes.backward_scope = outer
        param.grad = None

    params = [p for p in layer.parameters() if p.requires_grad]
    handles, versions = [], {}
    for p in params:
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        p.main_grad.gradient_accumulator = True  # the recorder tags the kernels writing it
        p.grad_added_to_main_grad = False
        versions[p] = p.main_grad._version
        handles.append(p.register_post_accumulate_grad_hook(hook))
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for p in params:
            del p.main_grad, p.grad_added_to_main_grad
