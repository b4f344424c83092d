"""Layout search: the fastest TP / PP / DP / micro-batch / recompute layouts that fit."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from megatron_boost.config.shape import MODES, ModelShape
from megatron_boost.config.modes import TPMode
from megatron_boost.perf.hardware import HardwareSpec
from megatron_boost.perf.model import RECOMPUTE, Layout, Prediction, predict

__all__ = ["recommend"]


def _divisors(x: int) -> List[int]:
    return [i for i in range(1, x + 1) if x % i == 0]


def recommend(shape: ModelShape, gpus: int, hw: HardwareSpec, modes: Sequence[str] = MODES,
              global_batch: Optional[int] = None, top: int = 3,
              micro_batches: Sequence[int] = (1, 2, 4, 8),
              recomputes: Sequence[str] = RECOMPUTE,
              gpus_per_node: Optional[int] = None) -> Dict[str, List[Prediction]]:
    """The fastest layouts per mode that fit in memory (ranked by tokens/s over the cluster).

    TP ranges over powers of two up to a node; PP over divisors of the layer count; DP fills the
    rest; the distributed optimizer is on whenever dp > 1. All layouts share one global batch
    (default ``8 · gpus`` sequences, which every micro-batch ≤ 8 × dp divides); layouts whose
    micro-batch × dp does not divide it are skipped.
    """
    gpn = gpus_per_node or hw.gpus_per_node
    global_batch = global_batch or 8 * gpus
    out: Dict[str, List[Prediction]] = {}
    for mode in modes:
        cands = []
        for tp in (1, 2, 4, 8, 16):
            if tp > gpn or gpus % tp or shape.heads % tp or shape.g % tp:
                continue
            for pp in _divisors(gpus // tp):
                if pp > shape.num_layers:
                    continue
                dp = gpus // (tp * pp)
                for b in micro_batches:
                    if global_batch % (b * dp):
                        continue
                    gb = global_batch
                    for rc in recomputes:
                        if rc == "lowrank" and not TPMode.parse(mode).is_lowrank:
                            continue
                        lay = Layout(mode=mode, tp=tp, pp=pp, dp=dp, micro_batch=b,
                                     global_batch=gb, recompute=rc,
                                     distributed_optimizer=dp > 1, gpus_per_node=gpn)
                        try:
                            pr = predict(shape, lay, hw)
                        except ValueError:
                            continue
                        if pr.fits:
                            cands.append(pr)
        cands.sort(key=lambda pr: pr.iteration_s)
        out[mode] = cands[:top]
    return out
