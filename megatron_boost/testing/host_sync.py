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

On a GPU, :class:`CudaSyncRecorder` asks the CUDA runtime side instead: under
``torch.cuda.set_sync_debug_mode("warn")`` torch warns at every synchronizing CUDA call made in
C++ (a device-to-host copy, ``nonzero``, a stream or event wait, ...), and the recorder keeps
each warning with the Python stack it surfaced in. Warnings raised in the backward engine's
threads surface at the ``backward()`` call that ran them.
"""

from __future__ import annotations

import collections
import traceback
import warnings
from dataclasses import dataclass
from typing import Dict, List

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HostSyncCounter", "CudaSyncRecorder", "SyncRecord", "SYNC_WARNING"]

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


#: What torch's warning under set_sync_debug_mode("warn") says (c10/cuda/CUDAFunctions.cpp,
#: warn_or_error_on_sync).
SYNC_WARNING = "called a synchronizing CUDA operation"

#: Frames of these packages are the ones a row names (the project's and megatron's code).
_OURS = ("/megatron_boost/", "/megatron/core/", "/tests/")

#: Frames of these files are the warning machinery, not where the sync was asked for.
_MACHINERY = (__file__, warnings.__file__)


@dataclass
class SyncRecord:
    """One synchronizing CUDA call: torch's message and the Python stack it surfaced in
    (outermost first)."""

    message: str
    stack: List[traceback.FrameSummary]

    def where(self, depth: int = 2) -> str:
        """The innermost ``depth`` frames of the project or megatron (else of anything),
        innermost last: what a row can show."""
        ours = [f for f in self.stack if any(part in f.filename for part in _OURS)]
        frames = (ours or self.stack)[-depth:]
        return " <- ".join(f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno} {f.name}"
                           for f in reversed(frames))

    def stack_text(self) -> str:
        return "".join(traceback.format_list(self.stack)) + self.message


class CudaSyncRecorder:
    """``with CudaSyncRecorder() as syncs: ...`` then ``syncs.records`` (one
    :class:`SyncRecord` per synchronizing CUDA call) and ``syncs.counts()`` (by where).
    Switches torch's sync debug mode to "warn" for the block when CUDA is available; any
    warning carrying :data:`SYNC_WARNING` is recorded instead of shown, every other warning
    is shown as before."""

    def __init__(self):
        self.records: List[SyncRecord] = []
        self._catch = None
        self._mode = None

    def counts(self) -> Dict[str, int]:
        return dict(collections.Counter(r.where() for r in self.records))

    def _record(self, message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING in str(message):
            stack = [f for f in traceback.extract_stack()[:-1] if f.filename not in _MACHINERY]
            self.records.append(SyncRecord(str(message), stack))
        else:
            self._show(message, category, filename, lineno, file, line)

    def __enter__(self):
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()  # restores the filters and showwarning on exit
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
        self._show = warnings.showwarning
        warnings.showwarning = self._record
        if torch.cuda.is_available():
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self._mode is not None:
            torch.cuda.set_sync_debug_mode(self._mode)
        self._catch.__exit__(*exc)
        return False
