"""The GPU check's stage 9 (docs/gpu.md): megatron's per-layer CUDA graphs
(``training.cuda_graph_impl: local``, docs/design.md §7) train as the eager layers do.

For naive and boost, the debug model is built twice from the same seed, eager and graphed, and
trained for :data:`GRAPH_STEPS` bf16 steps on one fixed global batch. megatron records the
layers' runners in the first steps and captures their graphs at the end of a forward-backward
(its schedules call ``create_cudagraphs``), so the later steps replay them. Rows: the graphs
were captured; the loss of every step equal within :data:`LOSS_RTOL`; the median step time
of the steps after the capture, eager and graphed. On the CPU the stage is not applicable.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import List, Tuple

from megatron_boost.runtime.stages import Row, check, emit, info
from megatron_boost.testing.gpu_stages import (Case, Plan, build_trainable, load_config,
                                               run_cases, synchronize, train_once)

__all__ = ["stage_cuda_graphs", "GRAPH_STEPS", "LOSS_RTOL"]

STAGE = 9
#: Steps per run: megatron's warm-up steps of a graph (cuda_graph_warmup_steps, 3 by default),
#: the capture, then replays to time.
GRAPH_STEPS = 8
#: The relative loss difference allowed per step, graphs on against off. A replay runs the
#: captured kernels on the same inputs, but the capture may choose other cuBLAS algorithms
#: (its own workspace), and bf16 keeps 8 significant bits (relative step 2^-8 = 0.4 %): a
#: few roundings of a bf16 sum reach about 1 %, a wrong replay (stale input, frozen state)
#: changes the loss far more.
LOSS_RTOL = 1e-2


def _train(plan: Plan, mode: str, graphs: str) -> Tuple[List[float], List[float]]:
    """(loss, seconds) of every step of the debug model in ``mode`` with
    ``training.cuda_graph_impl=graphs``."""
    cfg = load_config("configs/debug.yaml", [f"parallel.mode={mode}",
                                             f"training.cuda_graph_impl={graphs}"], plan.device)
    tr = build_trainable(cfg, "bf16", plan.device)
    losses, seconds = [], []
    for _ in range(GRAPH_STEPS):
        synchronize(plan.device)
        t0 = time.perf_counter()
        losses.append(train_once(tr)["loss"])
        synchronize(plan.device)
        seconds.append(time.perf_counter() - t0)
    return losses, seconds


def _graphs_captured() -> bool:
    """megatron's own record (the same class attribute in 0.16 to 0.19)."""
    from megatron.core.transformer.cuda_graphs import _CudagraphGlobalRecord

    return bool(_CudagraphGlobalRecord.cudagraph_created)


def _compare(plan: Plan, mode: str) -> None:
    """Eager first; the graphs are deleted after (megatron's record of them is global, and
    the next mode captures its own)."""
    from megatron.core.transformer.cuda_graphs import delete_cuda_graphs

    eager, eager_s = _train(plan, mode, "none")
    try:
        graphed, graphed_s = _train(plan, mode, "local")
        check(STAGE, f"{mode}: graphs captured", _graphs_captured(),
              "megatron's CudaGraphManager created the layers' graphs")
    finally:
        delete_cuda_graphs()
    worst = max(abs(g - e) / abs(e) for g, e in zip(graphed, eager))
    check(STAGE, f"{mode}: loss graphs on = off", worst <= LOSS_RTOL,
          f"{GRAPH_STEPS} steps, largest relative difference {worst:.2e} (allowed "
          f"{LOSS_RTOL:g}); last loss {eager[-1]:.4f} eager, {graphed[-1]:.4f} graphed")
    after = GRAPH_STEPS // 2  # steps past the warm-up and the capture
    on, off = statistics.median(graphed_s[after:]), statistics.median(eager_s[after:])
    info(STAGE, f"{mode}: step time", f"graphed {on * 1e3:.1f} ms, eager {off * 1e3:.1f} ms "
         f"(x{off / on:.2f}; median of steps {after + 1}-{GRAPH_STEPS})")


def stage_cuda_graphs(plan: Plan, work: Path) -> None:
    """Graphs on against off, naive and boost, one process; n/a on the CPU."""
    if plan.device != "cuda":
        emit(Row(STAGE, "graphs on = off", "n/a",
                 "no GPU: megatron captures CUDA graphs on CUDA streams only"))
        return
    from megatron_boost.testing.gpu_stages import setup_stage
    from megatron_boost.train.step import initialize_parallel

    setup_stage(plan, groups=False)
    # megatron's capture requires the RNG tracker's graph-safe states (both runs use them)
    initialize_parallel(1, 1, None, seed=1234, timeout_minutes=5.0, cuda_graphs=True)
    run_cases(STAGE, (Case(mode, lambda mode=mode: _compare(plan, mode))
                      for mode in ("naive", "boost")), plan.device)
