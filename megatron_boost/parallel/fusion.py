"""Fused elementwise regions: the layers' memory-bound glue written as functions that megatron's
``jit_fuser`` (``torch.compile`` on CUDA) compiles into one kernel each (docs/design.md §3, §17).

A region is a plain function of tensors: pointwise operations and at most a reduction over the
last dimension, no GEMM, no collective, no Python control flow on tensor values. On CUDA
:func:`fused_region` runs it through megatron's ``megatron.core.jit.jit_fuser`` (read when first
called, so megatron's ``disable_jit_fuser`` applies), compiled once per function as megatron
compiles its own fused SwiGLU; on the CPU it runs eagerly, one ATen kernel per operation
(megatron's jit fuser there would compile C++ in every process).
``tests/test_fusion.py`` compiles each region with torch's inductor on the CPU and checks that
it generates one kernel, and that the compiled and the eager region agree.

The op ledger (``measure/ledger.py``) observes the regions through :func:`observe_regions`: a
region's call is one kernel that reads its tensor arguments and writes its results, which is
what the compiled kernel moves; the eager kernels inside it are counted apart. Without an
observer a region costs one attribute read.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import torch

__all__ = ["fused_region", "observe_regions", "observed_call", "RegionObserver", "REGIONS"]

#: Every fused region defined, by name (``tests/test_fusion.py`` compiles each one).
REGIONS: dict = {}


class RegionObserver:
    """What the op ledger implements to see the regions (``measure/ledger.py``)."""

    def enter(self, name: str) -> None:
        """A region starts; its eager operations follow."""

    def exit(self, name: str, args: tuple, result: Any, kind: str = "fused") -> None:
        """The region ``name`` called on ``args`` returned ``result``; ``kind``: the class of
        kernel it stands for (a fused elementwise region, or the ledger's attention model)."""


_OBSERVER: Optional[RegionObserver] = None


@contextlib.contextmanager
def observe_regions(observer: RegionObserver) -> Iterator[RegionObserver]:
    """Make ``observer`` see every region call in the block (one observer at a time)."""
    global _OBSERVER
    if _OBSERVER is not None:
        raise RuntimeError("observe_regions: another observer is already active")
    _OBSERVER = observer
    try:
        yield observer
    finally:
        _OBSERVER = None


def _on_cuda(args: tuple) -> bool:
    return any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)


def observed_call(name: str, fn: Callable, *args, kind: str = "fused"):
    """``fn(*args)`` seen by the active observer as one kernel named ``name`` (the ledger
    wraps megatron's own fused functions with it while it records)."""
    observer = _OBSERVER
    if observer is None:
        return fn(*args)
    observer.enter(name)
    result = fn(*args)
    observer.exit(name, args, result, kind)
    return result


def fused_region(fn: Callable) -> Callable:
    """``fn`` as a fused region: compiled by megatron's ``jit_fuser`` when its tensors are on
    CUDA, eager otherwise; seen by the op ledger as one kernel. ``fn`` takes positional
    arguments only (tensors, and numbers or callables that the compiler specialises on)."""
    compiled: dict = {}

    def implementation(args: tuple) -> Callable:
        if not _on_cuda(args):
            return fn
        if "fn" not in compiled:
            from megatron.core import jit

            compiled["fn"] = jit.jit_fuser(fn)
        return compiled["fn"]

    @functools.wraps(fn)
    def run(*args):
        return observed_call(fn.__name__, implementation(args), *args)

    run.eager = fn
    REGIONS[fn.__name__] = run
    return run
