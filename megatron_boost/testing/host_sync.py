"""Counting the host synchronisations a piece of code requests.

On a GPU every device-to-host read (``.item()``, ``float(t)``, ``.tolist()``, ``.cpu()``, ...)
and every ``torch.cuda.synchronize()`` blocks the Python thread until the GPU has drained its
queue, so a training step should issue a small constant number of them, not one per parameter
or per micro-batch. :class:`HostSyncCounter` counts the requests themselves, so it works on the
CPU as well (where they cost nothing) and the count is the one a GPU run would see.

What is counted: Tensor.item, .tolist, .cpu, .numpy, ``float()``, ``int()`` and ``bool()`` of a
tensor (through a TorchFunctionMode), and torch.cuda.synchronize (wrapped while counting).
Not seen: calls made inside autograd's backward engine (it runs with an empty function-mode
stack), ``.to('cpu')`` and stream or event synchronisation.
"""

from __future__ import annotations

import collections

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostSyncCounter"]

_SYNCING_METHODS = {
    torch.Tensor.item: "item", torch.Tensor.tolist: "tolist", torch.Tensor.cpu: "cpu",
    torch.Tensor.numpy: "numpy", torch.Tensor.__float__: "float",
    torch.Tensor.__int__: "int", torch.Tensor.__bool__: "bool",
}


class HostSyncCounter(TorchFunctionMode):
    """``with HostSyncCounter() as syncs: ...`` then ``syncs.counts`` (kind -> calls) and
    ``syncs.total``."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        self._synchronize = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kind = _SYNCING_METHODS.get(func)
        if kind is not None:
            self.counts[kind] += 1
        return func(*args, **(kwargs or {}))

    def _counting_synchronize(self, *args, **kwargs):
        self.counts["cuda.synchronize"] += 1
        return self._synchronize(*args, **kwargs)

    def __enter__(self):
        self._synchronize = torch.cuda.synchronize
        torch.cuda.synchronize = self._counting_synchronize
        return super().__enter__()

    def __exit__(self, *exc):
        torch.cuda.synchronize = self._synchronize
        return super().__exit__(*exc)
