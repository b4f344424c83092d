"""FLOPs counted as torch executes them (``FlopCounterMode``), for checking the model-FLOP
formulas of ``analysis/flops.py`` against what runs."""

from __future__ import annotations

from torch.utils.flop_counter import FlopCounterMode

__all__ = ["count_flops"]


def count_flops(fn, *args, **kwargs):
    """(result of fn, total FLOPs counted by FlopCounterMode: mm/bmm/addmm/baddbmm/sdpa...)."""
    with FlopCounterMode(display=False) as counter:
        result = fn(*args, **kwargs)
    return result, int(counter.get_total_flops())
