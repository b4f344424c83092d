"""The GPU check's stages that run training on one process (docs/gpu.md; their plans and
shared pieces are :mod:`megatron_boost.testing.gpu_stages`):

0. environment: device, versions, megatron's chosen optimizer class, attention backend,
   ``CUDA_DEVICE_MAX_CONNECTIONS``.
1. {full, naive, boost} x {te, sdpa, local}: two bf16 steps at debug shapes.
2. save -> rebuild -> resume through the real trainer, bitwise-equal resumed losses (its
   trainer runs serve stage 8's TP=2 save/resume too).
4. host synchronisations of one whole trainer iteration: the CUDA runtime's sync warnings with
   their Python stacks on the GPU, the host-sync counter on the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import sys
from pathlib import Path
from typing import Dict, Iterable, Optional, Sequence, Tuple

from megatron_boost.runtime.stages import check, info
from megatron_boost.testing.gpu_stages import (
    BACKENDS,
    DETERMINISTIC_ENV,
    MODES,
    ROOT,
    Case,
    Plan,
    backend_unavailable,
    build_trainable,
    load_config,
    parameters_of,
    resume_attention,
    run_cases,
    setup_stage,
    te_unavailable_reason,
    train_once,
)

__all__ = ["stage_environment", "stage_steps", "stage_resume", "stage_host_syncs",
           "RESUME_OVERRIDES", "resumed_losses", "resume_row"]


# ---------------------------------------------------------------------------------------------
# stage 0: environment
# ---------------------------------------------------------------------------------------------


def _device_text(device: str) -> Tuple[str, str]:
    """(the device, its CUDA stack's versions)."""
    import torch

    if device != "cuda":
        return f"cpu (dry run; {torch.get_num_threads()} threads)", "CUDA not used"
    from megatron_boost.runtime.devices import peak_dense_bf16_tflops

    props = torch.cuda.get_device_properties(0)
    peak = peak_dense_bf16_tflops(props.name)
    peak_text = "not in the table (MFU n/a)" if peak is None else f"{peak:g} TFLOP/s"
    nccl = torch.cuda.nccl.version()  # a tuple, an int in older torch
    nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    return (f"{props.name} (sm_{props.major}{props.minor}, {props.total_memory / 2**30:.0f} GiB,"
            f" {torch.cuda.device_count()} visible) | peak dense bf16 {peak_text}",
            f"CUDA {torch.version.cuda} | cuDNN {torch.backends.cudnn.version()} | NCCL {nccl}")


def _optimizer_text(device: str) -> str:
    """The classes megatron's get_megatron_optimizer chose for a bf16 model (Transformer
    Engine's or apex's fused Adam when installed, else torch's AdamW)."""
    from megatron_boost.train.megatron_fixes import inner_torch_optimizers

    tr = build_trainable(load_config("configs/debug.yaml", [], device), "bf16", device)
    inner = inner_torch_optimizers(tr.optimizer)
    chain = getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])
    megatron_classes = "+".join(sorted({type(o).__name__ for o in chain}))
    torch_classes = sorted({f"{type(o).__module__}.{type(o).__name__}" for o in inner})
    fused = sorted({str(g.get("fused")) for o in inner for g in o.param_groups})
    return (f"{type(tr.optimizer).__name__} of {megatron_classes} over {torch_classes} | "
            f"fused={fused}")


def stage_environment(plan: Plan, work: Path) -> None:
    import platform

    import torch

    from megatron_boost.config.resolved import resolve_run

    setup_stage(plan)
    device, cuda = _device_text(plan.device)
    info(0, "device", device)
    from megatron_boost.runtime.backends import package_version

    te = package_version("transformer_engine", ("transformer-engine", "transformer_engine"))
    info(0, "versions", f"python {platform.python_version()} | torch {torch.__version__} | "
                        f"megatron-core {package_version('megatron.core', ('megatron-core',))} | "
                        f"transformer-engine {te} | apex {package_version('apex', ('apex',))} | "
                        f"{cuda}")
    info(0, "optimizer (bf16)", _optimizer_text(plan.device))
    debug = load_config("configs/debug.yaml", [], plan.device)
    run = resolve_run(debug, plan.device, vocab_size=debug.model.vocab_size)
    info(0, "attention backend (auto)", f"{run.attention_backend} ({run.attention_reason})")
    te_why = te_unavailable_reason(plan.device)
    info(0, "transformer engine", "imports" if te_why is None else f"unavailable: {te_why}")
    conns = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    text = f"{conns!r}" + ("" if conns == "1" else
                           " (megatron orders TP communication with 1; gpu_check.sh sets it)")
    if plan.device != "cuda":
        info(0, "CUDA_DEVICE_MAX_CONNECTIONS", text)
        return
    check(0, "CUDA_DEVICE_MAX_CONNECTIONS", conns == "1", text)
    info(0, "TF32", f"matmul allow_tf32={torch.backends.cuda.matmul.allow_tf32} | "
                    f"cudnn allow_tf32={torch.backends.cudnn.allow_tf32}")


# ---------------------------------------------------------------------------------------------
# stage 1: two bf16 steps per mode and attention backend
# ---------------------------------------------------------------------------------------------


def stage_steps(plan: Plan, work: Path) -> None:
    setup_stage(plan)
    run_cases(1, _step_cases(plan, te_unavailable_reason(plan.device)), plan.device)


def _step_cases(plan: Plan, te_why: Optional[str]) -> Iterable[Case]:
    for mode in MODES:
        for backend in BACKENDS:
            case = f"{mode} / {backend}"
            yield Case(case, functools.partial(_two_steps, plan, case, mode, backend),
                       backend_unavailable(backend, te_why))


def _two_steps(plan: Plan, case: str, mode: str, backend: str) -> None:
    cfg = load_config("configs/debug.yaml", [f"parallel.mode={mode}",
                                             f"model.attention_backend={backend}"], plan.device)
    tr = build_trainable(cfg, "bf16", plan.device)
    first, second = train_once(tr), train_once(tr)  # the same batch twice: the loss must go down
    params = parameters_of(tr)
    on_device = all(p.device.type == plan.device for p in params)
    losses = (first["loss"], second["loss"])
    norm = second["grad_norm"]  # None only without clipping (debug.yaml clips at 1.0)
    finite = all(math.isfinite(x) for x in losses) and norm is not None and math.isfinite(norm)
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in params})
    check(1, case, finite and losses[1] < losses[0] and on_device and not second["skipped"],
          f"loss {losses[0]:.4f} -> {losses[1]:.4f} | grad norm "
          f"{'none' if norm is None else f'{norm:.3g}'} | "
          f"{sum(p.numel() for p in params) / 1e6:.2f}M params ({'/'.join(dtypes)}) on "
          f"{sorted({str(p.device) for p in params})}")


# ---------------------------------------------------------------------------------------------
# stage 2: save -> rebuild -> resume through the trainer
# ---------------------------------------------------------------------------------------------


def _trainer_run(plan: Plan, run_dir: Path, overrides: Sequence[str],
                 world_size: int = 1) -> Dict[int, dict]:
    """The trainer (``train.trainer.train``, what pretrain's main runs) in this process, its
    console output to run_dir/console.log (console.rank<K>.log on rank K > 0); returns the
    metrics.jsonl records by iteration on rank 0 (which writes them), {} elsewhere. Each call
    builds the model from scratch; a world of one is shut down at the end, a larger one (a
    spawned world, stage 8) keeps its process group and loses only megatron's groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_boost.config.run import load_run_config
    from megatron_boost.runtime.cpu_mode import cpu_mode_left_as_found, maybe_use_cpu
    from megatron_boost.train import distributed
    from megatron_boost.train.trainer import train

    run_dir.mkdir(parents=True, exist_ok=True)
    rank = dist.get_rank() if dist.is_initialized() else 0
    cfg = load_run_config(str(ROOT / "configs/debug.yaml"), [
        f"training.device={plan.device}", "training.precision=bf16", "data.mock=true",
        "logging.tensorboard=false", f"logging.run_dir={run_dir}", *overrides], world_size)
    console = run_dir / ("console.log" if rank == 0 else f"console.rank{rank}.log")
    with open(console, "w") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log), cpu_mode_left_as_found():
        try:
            rc = train(cfg, maybe_use_cpu(plan.device))
        finally:
            if world_size == 1:
                distributed.shutdown()
            else:
                parallel_state.destroy_model_parallel()
    if rc != 0:
        tail = console.read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"training exited with {rc}: {' | '.join(tail)}")
    if rank != 0:
        return {}
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["iteration"]: r for r in map(json.loads, filter(str.strip, lines))}


#: Six iterations, a checkpoint at 3: what stages 2 and 8 save, resume and compare.
RESUME_OVERRIDES = ["training.train_iters=6", "optimizer.warmup_iters=2",
                    "checkpoint.save_interval=3", "training.eval_interval=100",
                    "training.eval_iters=0", "logging.log_interval=1"]


def resumed_losses(plan: Plan, work: Path, overrides: Sequence[str], world_size: int = 1):
    """(uninterrupted, resumed) metrics by iteration (rank 0; {} elsewhere): six iterations
    with a checkpoint at 3, then a second trainer that loads iteration 3 and trains 4-6."""
    common = [*overrides, *RESUME_OVERRIDES]
    ref = _trainer_run(plan, work / "uninterrupted", common, world_size)
    ckpt = work / "uninterrupted" / "checkpoints" / "iter_0000003"
    got = _trainer_run(plan, work / "resumed", [*common, f"checkpoint.load={ckpt}"], world_size)
    return ref, got


def resume_row(stage: int, case: str, ref: Dict[int, dict], got: Dict[int, dict]) -> None:
    """ok when the resumed losses of iterations 4-6 equal the uninterrupted run's bitwise."""
    diffs = [abs(got[i]["loss"] - ref[i]["loss"]) for i in (4, 5, 6)]
    check(stage, case, max(diffs) == 0.0 and sorted(got) == [4, 5, 6],
          f"loss it 1 {ref[1]['loss']:.4f}, it 6 {ref[6]['loss']:.4f} | resumed at 3: "
          f"iterations {sorted(got)}, max |diff| over 4-6 {max(diffs):.1e}"
          + (" (bitwise)" if max(diffs) == 0.0 else ""))


def stage_resume(plan: Plan, work: Path) -> None:
    import torch

    # Deterministic kernels where torch has them; warn_only: an op without one warns (in the
    # stage log) instead of stopping the check, and the comparison below then shows it.
    torch.use_deterministic_algorithms(True, warn_only=True)
    settings = ", ".join(f"{k}={v}" for k, v in DETERMINISTIC_ENV.items())
    info(2, "deterministic settings", f"torch.use_deterministic_algorithms(True, warn_only=True)"
                                      f", {settings}; criterion: bitwise-equal losses")
    run_cases(2, _resume_cases(plan, work, resume_attention(2, plan)), plan.device)


def _resume_cases(plan: Plan, work: Path, backend: str) -> Iterable[Case]:
    for dist_opt in (True, False):
        case = f"dist-opt {'on' if dist_opt else 'off'}, {backend} attention, bf16"
        yield Case(case, functools.partial(_resume_case, plan, work / f"resume_{int(dist_opt)}",
                                           case, dist_opt, backend))


def _resume_case(plan: Plan, work: Path, case: str, dist_opt: bool, backend: str) -> None:
    ref, got = resumed_losses(plan, work, [
        f"parallel.use_distributed_optimizer={str(dist_opt).lower()}",
        f"model.attention_backend={backend}"])
    resume_row(2, case, ref, got)


# ---------------------------------------------------------------------------------------------
# stage 4: host synchronisations of a whole trainer iteration
# ---------------------------------------------------------------------------------------------


def _trainer(plan: Plan, run_dir: Path, layers: int, micro: int):
    from megatron_boost.train.trainer import Trainer

    cfg = load_config("configs/debug.yaml", [
        f"model.num_layers={layers}", "training.micro_batch_size=2",
        f"training.global_batch_size={2 * micro}", "training.train_iters=20",
        "training.eval_iters=0", "logging.log_interval=100", "logging.tensorboard=false",
        f"logging.run_dir={run_dir}", "data.mock=true"], plan.device)
    return Trainer(cfg, plan.device)


def _close(trainer) -> None:
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

    trainer.metrics.close()
    trainer.writer.close()
    destroy_num_microbatches_calculator()
    parallel_state.destroy_model_parallel()


def _iteration_syncs(plan: Plan, run_dir: Path, layers: int, micro: int):
    """(kind -> count, the sync records on the GPU) of one ordinary trainer iteration after a
    warm-up iteration."""
    from megatron_boost.testing.host_sync import CudaSyncRecorder, HostSyncCounter

    with contextlib.redirect_stdout(sys.stderr):  # the trainer's banner to the stage's log
        trainer = _trainer(plan, run_dir, layers, micro)
    try:
        trainer.iteration()  # warm-up: lazy optimizer state and buffers
        if plan.device == "cuda":
            with CudaSyncRecorder() as syncs:
                trainer.iteration()
            return syncs.counts(), syncs.records
        with HostSyncCounter() as counter:
            trainer.iteration()
        return dict(counter.counts), []
    finally:
        _close(trainer)


def stage_host_syncs(plan: Plan, work: Path) -> None:
    """The CUDA runtime's own count on the GPU (torch.cuda.set_sync_debug_mode: it sees syncs
    in C++ too, the backward engine's included), the Python-level counter on the CPU."""
    setup_stage(plan, groups=False)
    how = ("torch.cuda.set_sync_debug_mode('warn')" if plan.device == "cuda" else
           "HostSyncCounter (Python-level calls only; the CPU has no CUDA runtime)")
    info(4, "counted by", how)
    counts = {}
    for name, layers, micro in (("small", 1, 1), ("large", 3, 4)):
        counts[name], records = _iteration_syncs(plan, work / name, layers, micro)
        info(4, f"{name}: {layers} layers, {micro} micro-batches",
             f"{sum(counts[name].values())} host syncs per trainer iteration"
             + ("" if records else f" {counts[name]}"))  # by kind on the CPU
        for where, n in counts[name].items() if records else ():
            info(4, f"{name}: {n} x sync at", where)
        for i, record in enumerate(records):  # each sync's whole stack, to the stage's log
            print(f"--- stage 4 {name} sync {i + 1} ---\n{record.stack_text()}",
                  file=sys.stderr, flush=True)
    check(4, "constant per iteration", counts["small"] == counts["large"],
          f"{sum(counts['small'].values())} vs {sum(counts['large'].values())} "
          f"(must not grow with parameters or micro-batches)")
