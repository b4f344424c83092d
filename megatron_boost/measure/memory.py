"""Saved activations: bytes of the tensors autograd keeps for backward (docs/design.md §7).

:class:`SavedActivations` counts them through ``torch.autograd.graph.saved_tensors_hooks``.
Unique storages are counted once, by their whole storage size (a saved view keeps its whole
storage alive); storages that belong to parameters (or any tensor passed in ``exclude``) are
left out. Only tensors packed outside a backward pass are counted, so the re-forward of
activation recompute (which runs inside backward) is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Optional

import torch

__all__ = ["SavedActivations", "SavedStorage"]


@dataclass
class SavedStorage:
    """One storage autograd keeps: its whole size, and the first tensor saved from it."""

    nbytes: int
    dtype: torch.dtype
    shape: tuple
    label: str = ""
    """What ``label`` (the op ledger's module scope) said when it was first saved."""


class SavedActivations:
    """Bytes autograd saves for backward while the context is active (forward passes).

    Usage::

        with SavedActivations(exclude=model.parameters()) as acc:
            loss = model(batch)           # one micro-batch forward, grad enabled
        acc.bytes, acc.count

    Every saved tensor is keyed by its storage (the storage object, so tensors without data, the
    op ledger's fake tensors, count too); a storage is counted once, at its full size. Storages of the tensors in ``exclude`` (parameters: their data, and any view of
    them such as ``weight.t()``) are not counted. Tensors packed while a backward pass runs
    (recompute re-forwards) are not counted. The pack hook returns the tensor itself, so the
    forward's memory behaviour is unchanged; the counted tensors all stay alive until their
    backward (or until the graph is dropped), so no storage address is reused while counting
    a single forward. Count one forward per context: across forward/backward pairs freed
    addresses can be reused and would be counted once.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = (),
                 label: Optional[Callable[[], str]] = None):
        self._excluded = {self._key(t) for t in exclude}
        self._label = label
        self.storages: Dict[int, SavedStorage] = {}
        self.packed = 0
        self.excluded_hits = 0
        self._ctx = None

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def _pack(self, t: torch.Tensor):
        if torch._C._current_graph_task_id() == -1:  # not inside a backward pass
            self.packed += 1
            try:
                key = self._key(t)
                nbytes = t.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):  # e.g. a tensor without storage
                key, nbytes = id(t), t.numel() * t.element_size()
            if key in self._excluded:
                self.excluded_hits += 1
            elif key not in self.storages:
                self.storages[key] = SavedStorage(nbytes, t.dtype, tuple(t.shape),
                                                  self._label() if self._label else "")
        return t

    @staticmethod
    def _unpack(t):
        return t

    @property
    def bytes(self) -> int:
        return sum(s.nbytes for s in self.storages.values())

    @property
    def count(self) -> int:
        return len(self.storages)

    def __enter__(self) -> "SavedActivations":
        self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        return False
