"""Recording the collectives a tensor-parallel group really issues (docs/design.md §5).

:func:`record_collectives` records every all-reduce / all-gather / reduce-scatter issued on a
given group while its ``with`` block is active (kind, direction, group size, elements, bytes),
including those issued by megatron-core's own layers and mappings.

How: for the duration of the block it replaces ``torch.distributed``'s entry points (and the
aliases megatron-core's ``tensor_parallel.mappings`` holds to them) by recording wrappers. The
replacement is process-wide, because megatron-core looks these functions up on their modules
at call time and offers no hook of its own. It is undone in a ``finally`` clause, so an
exception inside the block leaves nothing patched. Blocks may nest (each wrapper calls the one
it replaced, so an inner block's collectives are recorded by both logs, and each exit restores
exactly what its entry found); they must not interleave across threads. Outside a block
nothing is wrapped: the cost when disabled is zero.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional

import torch
from megatron.core.tensor_parallel import layers as _mcore_layers
from megatron.core.tensor_parallel import mappings as _mcore_mappings
from megatron.core.utils import get_pg_size

__all__ = ["record_collectives", "CollectiveRecord", "CommLog"]


@dataclass
class CollectiveRecord:
    """One collective seen by :func:`record_collectives`."""

    kind: str
    """'all_reduce', 'all_gather' or 'reduce_scatter'."""
    direction: str
    """'fwd' or 'bwd' (issued while autograd runs a backward pass)."""
    group_size: int
    """Number of ranks in the group."""
    numel: int
    """Elements handed to the collective by this rank (the full output for an all-gather)."""
    nbytes: int
    """numel times the element size."""
    width: int
    """Size of the last dimension of the tensor handed to the collective."""
    shape: tuple
    """Shape of that tensor."""
    async_op: bool = False
    """Issued with ``async_op=True`` (the caller waits on the returned handle later)."""
    issued_at: Optional[int] = None
    """The log's clock when it was issued (see :func:`record_collectives`)."""
    waited_at: Optional[int] = None
    """The clock when its handle was waited on: an asynchronous collective overlaps the work
    issued between the two; a synchronous one is complete when it returns."""


@dataclass
class CommLog:
    """The collectives recorded in one :func:`record_collectives` block."""

    records: List[CollectiveRecord] = field(default_factory=list)
    clock: Optional[Callable[[], int]] = None
    """Returns the caller's position in its own sequence of work (the op ledger's kernel
    count); stamped on each record when issued and when waited on."""

    def now(self) -> Optional[int]:
        return None if self.clock is None else self.clock()

    def select(self, direction: Optional[str] = None, kind: Optional[str] = None):
        return [r for r in self.records
                if (direction is None or r.direction == direction)
                and (kind is None or r.kind == kind)]

    def count(self, direction: Optional[str] = None, kind: Optional[str] = None) -> int:
        return len(self.select(direction, kind))

    def bytes(self, direction: Optional[str] = None, kind: Optional[str] = None) -> int:
        return sum(r.nbytes for r in self.select(direction, kind))

    def widths(self, direction: Optional[str] = None, kind: Optional[str] = None) -> List[int]:
        return [r.width for r in self.select(direction, kind)]

    def summary(self) -> dict:
        out = {}
        for d in ("fwd", "bwd"):
            out[d] = {"count": self.count(d), "bytes": self.bytes(d),
                      "widths": self.widths(d)}
        return out


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


# Positional index of the group argument, and of the tensor whose size is recorded:
# all_reduce(tensor, op, group); all_gather_into_tensor(output, input, group) records the
# gathered output; reduce_scatter_tensor(output, input, op, group) records the full input.
_GROUP_POS = {"all_reduce": 2, "all_gather": 2, "reduce_scatter": 3}
_TENSOR_POS = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 1}
_ASYNC_POS = {"all_reduce": 3, "all_gather": 3, "reduce_scatter": 4}

# (owner, attribute, kind): torch.distributed's entry points and megatron-core's module-level
# aliases of the all-gather / reduce-scatter functions (bound at its import time).
_TARGETS = [
    (torch.distributed, "all_reduce", "all_reduce"),
    (torch.distributed, "all_gather_into_tensor", "all_gather"),
    (torch.distributed, "reduce_scatter_tensor", "reduce_scatter"),
    (_mcore_mappings, "dist_all_gather_func", "all_gather"),
    (_mcore_mappings, "dist_reduce_scatter_func", "reduce_scatter"),
    # the sequence-parallel linear layers' own aliases
    (_mcore_layers, "dist_all_gather_func", "all_gather"),
    (_mcore_layers, "dist_reduce_scatter_func", "reduce_scatter"),
]


def _record(log: CommLog, kind: str, group, args, async_op: bool) -> CollectiveRecord:
    t = args[_TENSOR_POS[kind]]
    size = get_pg_size(group)
    # Width per token: an all-gather concatenates t inputs of [..., w/t] along dim 0, so its
    # per-token width is the input's last dim times t.
    width = (int(args[1].shape[-1]) * size if kind == "all_gather"
             else int(t.shape[-1]) if t.dim() else 1)
    record = CollectiveRecord(
        kind=kind, direction="bwd" if _in_backward() else "fwd", group_size=size,
        numel=t.numel(), nbytes=t.numel() * t.element_size(), width=width,
        shape=tuple(t.shape), async_op=async_op, issued_at=log.now())
    log.records.append(record)
    return record


class _ObservedWork:
    """An asynchronous collective's handle that stamps the log's clock on the record when it
    is waited on; everything else is the handle's own."""

    def __init__(self, work, record: CollectiveRecord, log: CommLog):
        self._work, self._record, self._log = work, record, log

    def wait(self, *args, **kwargs):
        out = self._work.wait(*args, **kwargs)
        if self._record.waited_at is None:
            self._record.waited_at = self._log.now()
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _argument(args, kwargs, name: str, pos: int, default=None):
    return kwargs[name] if name in kwargs else (args[pos] if len(args) > pos else default)


def _recording(fn, kind: str, group, log: CommLog):
    """``fn`` that also records its call in ``log`` when it is issued on ``group``."""
    def wrapped(*args, **kwargs):
        if _argument(args, kwargs, "group", _GROUP_POS[kind]) is not group:
            return fn(*args, **kwargs)
        async_op = bool(_argument(args, kwargs, "async_op", _ASYNC_POS[kind], False))
        record = _record(log, kind, group, args, async_op)
        work = fn(*args, **kwargs)
        if async_op and work is not None:
            return _ObservedWork(work, record, log)
        record.waited_at = log.now()
        return work
    return wrapped


@contextlib.contextmanager
def record_collectives(group, clock: Optional[Callable[[], int]] = None) -> Iterator[CommLog]:
    """Record every all-reduce / all-gather / reduce-scatter issued on ``group`` in the block.

    Collectives on other groups (data-parallel gradient reduction, pipeline p2p) are not
    recorded; a group of one rank (or None) issues none, and nothing is wrapped. Usage::

        with record_collectives(tp_group) as log:
            loss = model(x).sum(); loss.backward()
        log.count("fwd"), log.bytes("bwd")

    ``clock`` (optional): a function giving the caller's position in its own sequence of work,
    stamped on each record when issued and waited on (the op ledger's kernel count).
    """
    log = CommLog(clock=clock)
    if get_pg_size(group) == 1:
        yield log
        return
    saved = []
    try:
        for owner, name, kind in _TARGETS:
            fn = getattr(owner, name)
            saved.append((owner, name, fn))
            setattr(owner, name, _recording(fn, kind, group, log))
        yield log
    finally:
        for owner, name, fn in reversed(saved):
            setattr(owner, name, fn)
