"""FLOPs counted as torch executes them (``FlopCounterMode``), for checking the model-FLOP
formulas of ``analysis/flops.py`` against what runs."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["count_flops"]


def _addmm_inplace_flops(self_shape, a_shape, b_shape, out_shape=None, **kwargs) -> int:
    """``C.addmm_(A, B)``: the GEMM A·B accumulated into C (beta = 1), 2·M·N·K as torch counts
    ``addmm``. torch's counter has no formula for the in-place form, which boost's A side runs
    to add dx into the residual's gradient (``parallel/residual.py``)."""
    m, k = a_shape
    _, n = b_shape
    return 2 * m * n * k


def count_flops(fn, *args, **kwargs):
    """(result of fn, total FLOPs counted by FlopCounterMode: mm/bmm/addmm/addmm_/baddbmm/sdpa...)."""
    mapping = {torch.ops.aten.addmm_: _addmm_inplace_flops}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        result = fn(*args, **kwargs)
    return result, int(counter.get_total_flops())
