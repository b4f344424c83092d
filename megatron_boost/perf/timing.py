"""Device time of a piece of work: CUDA events on the GPU, the host clock on the CPU (the GPU
check's layer and attention stages, docs/gpu.md)."""

from __future__ import annotations

import time
from typing import Callable, List, Tuple

import torch

__all__ = ["DeviceTimer", "projection_gemm_ms"]


class DeviceTimer:
    """Median milliseconds of a function: CUDA events on the GPU (device time between the
    events, no host clock), the host clock on the CPU (where work is synchronous)."""

    def __init__(self, device: str):
        self.device = device

    def median_ms(self, fn: Callable[[], None], iters: int, warmup: int = 1) -> float:
        for _ in range(warmup):
            fn()
        if self.device == "cuda":
            pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                     for _ in range(iters)]
            for start, end in pairs:
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            times = [start.elapsed_time(end) for start, end in pairs]
        else:
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
        return sorted(times)[len(times) // 2]


def projection_gemm_ms(device: str, factors: List[Tuple[int, int]], tokens: int, dtype,
                       iters: int) -> float:
    """Device milliseconds of the forward, input-gradient and weight-gradient GEMMs of every
    (k, n) factor, in the layouts of a linear layer (weight [n, k])."""
    operands = [(torch.randn(tokens, k, device=device, dtype=dtype),
                 torch.randn(n, k, device=device, dtype=dtype),
                 torch.randn(tokens, n, device=device, dtype=dtype)) for k, n in factors]

    def gemms():
        for x, w, g in operands:
            torch.mm(x, w.t())  # forward [T, k] x [k, n]
            torch.mm(g, w)  # input gradient [T, n] x [n, k]
            torch.mm(g.t(), x)  # weight gradient [n, T] x [T, k]

    return DeviceTimer(device).median_ms(gemms, iters)
