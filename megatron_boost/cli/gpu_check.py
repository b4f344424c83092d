"""Readiness check of one CUDA GPU in one command (``tools/gpu_check.sh``), as stages.

    tools/gpu_check.sh                 # one CUDA GPU
    tools/gpu_check.sh --cpu           # the same stages on the CPU at tiny shapes
    tools/gpu_check.sh --stages 0,3    # a selection

Every stage runs in a subprocess of its own with its own time limit (and the whole check under
``--deadline``). A stage prints its rows the moment each is measured; a stage that raises,
crashes or runs out of time gets a FAIL / TIMEOUT row with the reason, and the next stage
still runs. Exit status 1 when any stage failed. The stages (docs/gpu.md):

0. environment: device, versions, megatron's chosen optimizer class, attention backend,
   ``CUDA_DEVICE_MAX_CONNECTIONS``.
1. {full, naive, boost} x {te, sdpa, local}: two bf16 steps at debug shapes; finite and
   decreasing losses, parameters on the device. te without Transformer Engine is a reported
   "unavailable" row, not a pass.
2. save -> rebuild -> resume through the real trainer, distributed optimizer on and off,
   TE attention where available, under deterministic settings: resumed losses bitwise equal.
3. naive and boost at TP=1 from the same global weights: equal losses (fp32 1e-5, bf16 3e-2).
4. host synchronisations of one training step: the same count for a model 3x deeper with 4x
   the micro-batches.
5. throughput and MFU at cola-350m shapes, TP=1, boost and full rank (explicit budget).
6. one decoder layer at s=8192 per attention backend: time, saved activations, peak memory;
   out-of-memory is a reported row.
7. per-rank layer shapes of cola-1b / cola-7b at TP=1/2/4: layer time, and the projection GEMMs
   of the analytic shape (``analysis/shape.py``) timed with device events; FLOPs from the shape.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[2]
MODES = ("full", "naive", "boost")
BACKENDS = ("te", "sdpa", "local")

#: Test hooks (tests/test_gpu_check.py): the stage with this number raises at its start, or
#: sleeps past any limit, so the check's handling of a failing stage is exercised.
FAIL_STAGE_ENV = "MBOOST_GPU_CHECK_FAIL_STAGE"
HANG_STAGE_ENV = "MBOOST_GPU_CHECK_HANG_STAGE"

#: Stage 2's deterministic settings, set in its environment before torch starts (cuBLAS reads
#: the workspace setting at handle creation, Transformer Engine its flag at import).
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}

# Tolerances of stage 3 (docs/design.md §11): fp32 sums the same products in another order
# (boost fuses the RMSNorm into the A GEMM, §3): ~sqrt(K)·2^-24 observed <= 1e-6, so 1e-5;
# bf16 rounds a few times through A, the norm, σ and B at 2^-8 each: 3e-2.
EQUIVALENCE_TOLERANCE = {"fp32": 1e-5, "bf16": 3e-2}


# ---------------------------------------------------------------------------------------------
# plans: the sizes of every stage on the GPU and in the CPU dry run
# ---------------------------------------------------------------------------------------------


@dataclass
class Plan:
    """Sizes and limits of every stage; :func:`gpu_plan` or :func:`cpu_plan`. Stages 1-4
    run configs/debug.yaml as it is (2 layers, d=64) on either device."""

    device: str
    limits: Dict[int, float]
    """Seconds each stage may run (its subprocess is killed after that)."""
    deadline: float
    """Seconds the whole check may run; a stage gets at most what is left."""
    throughput_overrides: List[str]
    """Stage 5: on top of configs/cola-350m.yaml, its own budget included (the file sets a
    token budget, which a training.train_iters override replaces)."""
    warmup_steps: int
    """Stage 5: steps not timed (allocator, kernel autotuning)."""
    attention_seq: int = 8192
    """Stage 6: sequence length of the one-layer input (micro-batch 1)."""
    attention_model: str = "cola-1b"
    """Stage 6: configs/<name>.yaml whose layer shape is run."""
    layer_models: Tuple[str, ...] = ("cola-1b", "cola-7b")
    """Stage 7: configs/<name>.yaml whose per-rank layer shapes are run."""
    layer_tps: Tuple[int, ...] = (1, 2, 4)
    """Stage 7: tensor-parallel sizes whose one-rank shapes are run."""
    layer_tokens: Tuple[int, int] = (2048, 4)
    """Stage 7: (sequence, micro-batch) of the layer input."""
    timing_iters: int = 10
    """Timed repetitions (median) of a layer or GEMM set, after one warm-up."""


def gpu_plan() -> Plan:
    return Plan(
        device="cuda",
        # stage 0 pays the cold start: first imports of torch, megatron and TE, CUDA context
        limits={0: 90, 1: 90, 2: 100, 3: 45, 4: 45, 5: 100, 6: 60, 7: 80},
        deadline=470.0,
        throughput_overrides=["parallel.tp=1", "training.micro_batch_size=4",
                              "training.global_batch_size=4", "training.train_iters=20",
                              "optimizer.warmup_iters=1"],
        warmup_steps=5)


def cpu_plan() -> Plan:
    tiny = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
            "model.num_attention_heads=4", "model.attn_rank=16", "model.mlp_rank=16",
            "model.vocab_size=256", "model.seq_length=32"]
    return Plan(
        device="cpu",
        # generous: the suite shares its cores; a limit here catches a hang, not slowness
        limits={s: 300 for s in range(8)},
        deadline=1500.0,
        throughput_overrides=["parallel.tp=1", *tiny, "training.micro_batch_size=2",
                              "training.global_batch_size=2", "training.train_iters=3",
                              "optimizer.warmup_iters=1"],
        warmup_steps=1, attention_seq=128, attention_model="debug", layer_models=("debug",),
        layer_tps=(1, 2), layer_tokens=(32, 2), timing_iters=2)


# ---------------------------------------------------------------------------------------------
# rows
# ---------------------------------------------------------------------------------------------


@dataclass
class Row:
    stage: int
    case: str
    status: str  # ok | FAIL | TIMEOUT | info | n/a
    result: str


STAGE_NAMES = {0: "environment", 1: "bf16 steps", 2: "save/resume", 3: "naive=boost",
               4: "host syncs", 5: "throughput", 6: "attention", 7: "layer GEMMs"}


def format_row(row: Row) -> str:
    name = STAGE_NAMES.get(row.stage, "")
    return f"[{row.stage}] {name:<12} {row.case:<40} {row.status:<7} {row.result}"


#: FAIL rows printed by this process (a stage's exit status).
_failed_rows = [0]


def emit(row: Row) -> Row:
    """Print a row now (the stage's stdout is the check's stdout)."""
    _failed_rows[0] += row.status == "FAIL"
    print(format_row(row), flush=True)
    return row


def check(stage: int, case: str, ok: bool, result: str) -> Row:
    return emit(Row(stage, case, "ok" if ok else "FAIL", result))


def info(stage: int, case: str, result: str) -> Row:
    return emit(Row(stage, case, "info", result))


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


# ---------------------------------------------------------------------------------------------
# common pieces of the stages (run inside a stage's subprocess)
# ---------------------------------------------------------------------------------------------


def _setup(plan: Plan, seed: int = 1234) -> None:
    """A world of one on the plan's device (CPU mode for the dry run), TP=PP=1 groups."""
    from megatron_boost.runtime.cpu_mode import maybe_use_cpu
    from megatron_boost.train.distributed import init_distributed
    from megatron_boost.train.resilience import process_group_timeout
    from megatron_boost.train.step import initialize_parallel

    maybe_use_cpu(plan.device)
    init_distributed(plan.device, process_group_timeout(5.0))
    initialize_parallel(1, 1, None, seed=seed, timeout_minutes=5.0)


def _synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _load(config: str, overrides: Sequence[str], device: str):
    from megatron_boost.config.run import load_run_config

    return load_run_config(str(ROOT / config), [*overrides, f"training.device={device}"])


def te_unavailable_reason(device: str) -> Optional[str]:
    """Why Transformer Engine attention cannot run here, or None when it can."""
    if device != "cuda":
        return "Transformer Engine needs CUDA (this is the CPU dry run)"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # ImportError, or OSError from missing CUDA libraries
        return f"transformer_engine does not import ({one_line(err)})"
    return None


@dataclass
class Trainable:
    """A model chunk list, its optimizer and a batch source: what train_step needs."""

    cfg: object
    ddp: list
    optimizer: object
    forward_step: Callable
    micro_batches: list


def _build_trainable(cfg, precision: str, device: str,
                     num_microbatches: Optional[int] = None) -> Trainable:
    """The run's model from the one builder (layout-independent init from the run's seed, so
    every mode starts from the same global weights, docs/design.md §8), megatron's optimizer
    and one fixed global batch."""
    from megatron_boost.config.resolved import resolve_run
    from megatron_boost.data.synthetic import synthetic_microbatches
    from megatron_boost.train.build import build_run

    # A constant learning rate from the first step (no warmup), as the benchmark uses: the
    # check takes a few steps and reads whether the loss falls.
    cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, warmup_iters=0))
    run = resolve_run(cfg, device, vocab_size=cfg.model.vocab_size).with_precision(precision)
    built = build_run(run)
    t = cfg.training
    gbs = t.micro_batch_size * (num_microbatches or t.global_batch_size // t.micro_batch_size)
    micro = synthetic_microbatches(cfg.model.vocab_size, cfg.model.seq_length,
                                   t.micro_batch_size, gbs, run.seed + 1)
    micro = [{k: v.to(device) for k, v in m.items()} for m in micro]
    return Trainable(cfg, built.chunks, built.optimizer, built.forward_step, micro)


def _step(tr: Trainable) -> dict:
    """One optimizer step on the trainable's fixed global batch."""
    from megatron_boost.train.step import train_step

    t = tr.cfg.training
    return train_step(tr.forward_step, [iter(tr.micro_batches)], tr.ddp, tr.optimizer,
                      len(tr.micro_batches), tr.cfg.model.seq_length, t.micro_batch_size)


def _params(tr: Trainable):
    return [p for chunk in tr.ddp for p in chunk.module.parameters()]


class DeviceTimer:
    """Median milliseconds of a function: CUDA events on the GPU (device time between the
    events, no host clock), the host clock on the CPU (where work is synchronous)."""

    def __init__(self, device: str):
        self.device = device

    def median_ms(self, fn: Callable[[], None], iters: int, warmup: int = 1) -> float:
        import torch

        for _ in range(warmup):
            fn()
        times = []
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
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append(1e3 * (time.perf_counter() - t0))
        return sorted(times)[len(times) // 2]


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

    tr = _build_trainable(_load("configs/debug.yaml", [], device), "bf16", device)
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

    _setup(plan)
    device, cuda = _device_text(plan.device)
    info(0, "device", device)
    from megatron_boost.cli.env import package_version

    te = package_version("transformer_engine", ("transformer-engine", "transformer_engine"))
    info(0, "versions", f"python {platform.python_version()} | torch {torch.__version__} | "
                        f"megatron-core {package_version('megatron.core', ('megatron-core',))} | "
                        f"transformer-engine {te} | apex {package_version('apex', ('apex',))} | "
                        f"{cuda}")
    info(0, "optimizer (bf16)", _optimizer_text(plan.device))
    debug = _load("configs/debug.yaml", [], plan.device)
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
    _setup(plan)
    te_why = te_unavailable_reason(plan.device)
    for mode in MODES:
        for backend in BACKENDS:
            case = f"{mode} / {backend}"
            if backend == "te" and te_why is not None:
                emit(Row(1, case, "n/a", f"unavailable: {te_why}"))
                continue
            try:
                _two_steps(plan, case, mode, backend)
            except Exception as err:  # one case failing does not hide the others
                check(1, case, False, one_line(err))
            _free(plan.device)


def _two_steps(plan: Plan, case: str, mode: str, backend: str) -> None:
    cfg = _load("configs/debug.yaml", [f"parallel.mode={mode}",
                                       f"model.attention_backend={backend}"], plan.device)
    tr = _build_trainable(cfg, "bf16", plan.device)
    first, second = _step(tr), _step(tr)  # the same batch twice: the loss must go down
    params = _params(tr)
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


def _trainer_run(plan: Plan, run_dir: Path, overrides: Sequence[str]) -> Dict[int, dict]:
    """pretrain's main in this process, its console output and error line to
    run_dir/console.log; returns the metrics.jsonl records by iteration. Each call builds the
    model from scratch and shuts its process groups down at the end."""
    from megatron_boost.cli.pretrain import main as pretrain_main

    run_dir.mkdir(parents=True, exist_ok=True)
    argv = ["--config", str(ROOT / "configs/debug.yaml"), f"training.device={plan.device}",
            "training.precision=bf16", "data.mock=true", "logging.tensorboard=false",
            f"logging.run_dir={run_dir}", *overrides]
    with open(run_dir / "console.log", "w") as log, contextlib.redirect_stdout(log), \
            contextlib.redirect_stderr(log):
        rc = pretrain_main(argv)
    if rc != 0:
        tail = (run_dir / "console.log").read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"training exited with {rc}: {' | '.join(tail)}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["iteration"]: r for r in map(json.loads, filter(str.strip, lines))}


def stage_resume(plan: Plan, work: Path) -> None:
    import torch

    # Deterministic kernels where torch has them; warn_only: an op without one warns (in the
    # stage log) instead of stopping the check, and the comparison below then shows it.
    torch.use_deterministic_algorithms(True, warn_only=True)
    settings = ", ".join(f"{k}={v}" for k, v in DETERMINISTIC_ENV.items())
    info(2, "deterministic settings", f"torch.use_deterministic_algorithms(True, warn_only=True)"
                                      f", {settings}; criterion: bitwise-equal losses")
    te_why = te_unavailable_reason(plan.device)
    backend = "te" if te_why is None else "sdpa"
    if te_why is not None:
        emit(Row(2, "te attention", "n/a", f"unavailable: {te_why}; resume runs with sdpa"))
    for dist_opt in (True, False):
        case = f"dist-opt {'on' if dist_opt else 'off'}, {backend} attention, bf16"
        try:
            _resume_case(plan, work / f"resume_{int(dist_opt)}", case, dist_opt, backend)
        except Exception as err:
            check(2, case, False, one_line(err))


def _resume_case(plan: Plan, work: Path, case: str, dist_opt: bool, backend: str) -> None:
    common = [f"parallel.use_distributed_optimizer={str(dist_opt).lower()}",
              f"model.attention_backend={backend}", "training.train_iters=6",
              "optimizer.warmup_iters=2", "checkpoint.save_interval=3",
              "training.eval_interval=100", "training.eval_iters=0", "logging.log_interval=1"]
    ref = _trainer_run(plan, work / "uninterrupted", common)
    ckpt = work / "uninterrupted" / "checkpoints" / "iter_0000003"
    got = _trainer_run(plan, work / "resumed", [*common, f"checkpoint.load={ckpt}"])
    diffs = [abs(got[i]["loss"] - ref[i]["loss"]) for i in (4, 5, 6)]
    check(2, case, max(diffs) == 0.0 and sorted(got) == [4, 5, 6],
          f"loss it 1 {ref[1]['loss']:.4f}, it 6 {ref[6]['loss']:.4f} | resumed at 3: "
          f"iterations {sorted(got)}, max |diff| over 4-6 {max(diffs):.1e}"
          + (" (bitwise)" if max(diffs) == 0.0 else ""))


# ---------------------------------------------------------------------------------------------
# stage 3: naive = boost at TP=1
# ---------------------------------------------------------------------------------------------


def stage_equivalence(plan: Plan, work: Path) -> None:
    import torch

    _setup(plan)
    # fp32 means fp32: no TF32 in the GEMMs of either model.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for precision, tol in EQUIVALENCE_TOLERANCE.items():
        losses = {}
        for mode in ("naive", "boost"):
            cfg = _load("configs/debug.yaml", [f"parallel.mode={mode}",
                                               "model.attention_backend=sdpa"], plan.device)
            tr = _build_trainable(cfg, precision, plan.device)
            losses[mode] = [_step(tr)["loss"] for _ in range(2)]
            del tr
            _free(plan.device)
        rel = max(abs(a - b) / abs(b) for a, b in zip(losses["naive"], losses["boost"]))
        check(3, f"{precision}, two steps, sdpa", math.isfinite(rel) and rel <= tol,
              f"naive {losses['naive'][0]:.6f}, {losses['naive'][1]:.6f} | boost "
              f"{losses['boost'][0]:.6f}, {losses['boost'][1]:.6f} | max rel diff {rel:.1e} "
              f"(tolerance {tol:g})")


# ---------------------------------------------------------------------------------------------
# stage 4: host synchronisations of one step
# ---------------------------------------------------------------------------------------------


def stage_host_syncs(plan: Plan, work: Path) -> None:
    from megatron_boost.testing.host_sync import HostSyncCounter

    _setup(plan)
    counts, sizes = {}, {}
    for name, layers, micro in (("small", 1, 1), ("large", 3, 4)):
        cfg = _load("configs/debug.yaml", [f"model.num_layers={layers}"], plan.device)
        tr = _build_trainable(cfg, "bf16", plan.device, num_microbatches=micro)
        _step(tr)  # warm-up: lazy optimizer state and buffers
        with HostSyncCounter() as syncs:
            _step(tr)
        counts[name] = dict(syncs.counts)
        sizes[name] = (layers, micro, sum(p.numel() for p in _params(tr)))
        del tr
        _free(plan.device)
    for name, (layers, micro, n) in sizes.items():
        info(4, f"{name}: {layers} layers, {micro} micro-batches",
             f"{n / 1e6:.2f}M params | {sum(counts[name].values())} host syncs per step "
             f"{counts[name]}")
    check(4, "constant per step", counts["small"] == counts["large"],
          f"{sum(counts['small'].values())} vs {sum(counts['large'].values())} "
          f"(must not grow with parameters or micro-batches)")


# ---------------------------------------------------------------------------------------------
# stage 5: throughput and MFU
# ---------------------------------------------------------------------------------------------


def stage_throughput(plan: Plan, work: Path) -> None:
    _setup(plan)
    for mode in ("boost", "full"):
        try:
            _throughput_case(plan, mode)
        except Exception as err:
            check(5, f"cola-350m {mode}", False, one_line(err))
        _free(plan.device)


def _throughput_case(plan: Plan, mode: str) -> None:
    import torch

    from megatron_boost.analysis.flops import flops_per_token, peak_tflops
    from megatron_boost.config.validation import train_iterations
    from megatron_boost.config.resolved import padded_vocab_size

    cfg = _load("configs/cola-350m.yaml", [*plan.throughput_overrides, f"parallel.mode={mode}"],
                plan.device)
    steps = train_iterations(cfg)  # the explicit budget: configs/cola-350m.yaml has tokens
    if steps <= plan.warmup_steps:
        raise ValueError(f"budget of {steps} steps leaves none after {plan.warmup_steps} "
                         f"warm-up steps")
    tr = _build_trainable(cfg, "bf16", plan.device)
    losses = [_step(tr)["loss"] for _ in range(plan.warmup_steps)]
    if plan.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    _synchronize(plan.device)
    t0 = time.perf_counter()
    for _ in range(steps - plan.warmup_steps):
        losses.append(_step(tr)["loss"])
    _synchronize(plan.device)
    seconds = time.perf_counter() - t0
    t = cfg.training
    tokens_per_s = (steps - plan.warmup_steps) * t.global_batch_size * cfg.model.seq_length \
        / seconds
    vocab = padded_vocab_size(cfg.model.vocab_size, cfg.parallel.tp)
    achieved = flops_per_token(cfg, mode, vocab_size=vocab) * tokens_per_s / 1e12
    peak = peak_tflops(cfg.logging.peak_tflops, plan.device)
    mfu = "MFU n/a (no peak for this device)" if peak is None else \
        f"MFU {100 * achieved / peak:.1f}% of {peak:g}"
    mem = (f" | peak mem {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
           if plan.device == "cuda" else "")
    m = cfg.model
    check(5, f"cola-350m shapes {mode}", all(math.isfinite(x) for x in losses),
          f"{steps} steps ({plan.warmup_steps} warm-up), {m.num_layers}x d={m.hidden_size} "
          f"seq {m.seq_length} mbs {t.micro_batch_size} | {tokens_per_s:,.0f} tok/s | "
          f"{achieved:.3g} TFLOP/s model | {mfu}{mem} | loss {losses[0]:.3f} -> "
          f"{losses[-1]:.3f}")


# ---------------------------------------------------------------------------------------------
# stage 6: attention backends at a long sequence
# ---------------------------------------------------------------------------------------------


def _layer_config(config_file: str, overrides: Sequence[str], mode: str, backend: str,
                  device: str, precision: str = "bf16"):
    """The megatron config of one decoder layer (weights left uninitialised: only times and
    memory are measured)."""
    from megatron_boost.config.resolved import resolve_run, to_transformer_config

    cfg = _load(config_file, [*overrides, "model.num_layers=1", "parallel.tp=1",
                              f"parallel.mode={mode}", f"model.attention_backend={backend}"],
                device)
    run = resolve_run(cfg, device, vocab_size=cfg.model.vocab_size).with_precision(precision)
    return cfg, to_transformer_config(run, perform_initialization=False)


def stage_attention(plan: Plan, work: Path) -> None:
    _setup(plan)
    te_why = te_unavailable_reason(plan.device)
    for backend in BACKENDS:
        case = f"{plan.attention_model} boost layer s={plan.attention_seq} {backend}"
        if backend == "te" and te_why is not None:
            emit(Row(6, case, "n/a", f"unavailable: {te_why}"))
            continue
        try:
            _attention_case(plan, case, backend)
        except Exception as err:
            if _is_oom(err):
                emit(Row(6, case, "info", f"out of memory: {one_line(err)[:160]}"))
            else:
                check(6, case, False, one_line(err))
        _free(plan.device)


def _is_oom(err: BaseException) -> bool:
    import torch

    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def _attention_case(plan: Plan, case: str, backend: str) -> None:
    import torch

    from megatron_boost.analysis.comm import build_decoder_layer
    from megatron_boost.analysis.memory import SavedActivations

    _, config = _layer_config(f"configs/{plan.attention_model}.yaml",
                              [f"model.seq_length={plan.attention_seq}"], "boost", backend,
                              plan.device)
    layer = build_decoder_layer(config).to(plan.device)
    x = torch.randn(plan.attention_seq, 1, config.hidden_size, device=plan.device,
                    dtype=config.params_dtype, requires_grad=True)  # [s, b=1, d]

    def step():
        out = layer(x, attention_mask=None)[0]
        out.backward(torch.ones_like(out))

    if plan.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    ms = DeviceTimer(plan.device).median_ms(step, max(1, plan.timing_iters // 2))
    peak = (f"peak {(torch.cuda.max_memory_allocated() - base) / 2**30:.2f} GiB above weights "
            f"and input" if plan.device == "cuda" else "peak n/a on the CPU")
    with SavedActivations(exclude=layer.parameters()) as saved:
        out = layer(x, attention_mask=None)[0]
    del out
    check(6, case, True, f"{ms:.2f} ms fwd+bwd | saved for backward "
                         f"{saved.bytes / 2**20:.1f} MiB | {peak}")


# ---------------------------------------------------------------------------------------------
# stage 7: per-rank layer shapes, GEMM time from device events, FLOPs from the shape
# ---------------------------------------------------------------------------------------------


def rank_local_shape(shape, mode: str, tp: int):
    """The one-process layer whose GEMMs are those of one rank at tensor parallelism ``tp``
    (docs/design.md §2), as a :class:`~megatron_boost.analysis.shape.ModelShape`: full shards
    heads and ffn; naive shards the bottleneck ranks (attention, the MLP activation and the
    norms are replicated); boost shards the hidden stream, heads and ffn, and keeps the full
    ranks (its A GEMMs reduce d/t-wide inputs)."""
    local = dataclasses.replace(shape, head_dim=shape.e)  # e stays e when d or h shrink
    heads = dict(heads=shape.heads // tp, query_groups=shape.g // tp)
    if mode == "full":
        return dataclasses.replace(local, ffn=shape.ffn // tp, **heads)
    if mode == "naive":
        return dataclasses.replace(local, attn_rank=shape.r_attn // tp,
                                   mlp_rank=shape.r_mlp // tp)
    return dataclasses.replace(local, hidden=shape.hidden // tp, ffn=shape.ffn // tp, **heads)


def shape_overrides(shape) -> List[str]:
    """model.* overrides that build a layer of ``shape``."""
    return [f"model.hidden_size={shape.hidden}", f"model.ffn_hidden_size={shape.ffn}",
            f"model.num_attention_heads={shape.heads}",
            f"model.num_query_groups={shape.g}", f"model.kv_channels={shape.e}",
            f"model.attn_rank={shape.r_attn}", f"model.mlp_rank={shape.r_mlp}"]


def projection_gemms(shape, mode: str) -> List[Tuple[int, int]]:
    """(k, n) of every weight factor of one layer's projections (``ModelShape.projections``):
    a dense W maps k = d_in to n = d_out; a bottleneck is A (d_in -> r) and B (r -> d_out).
    Each runs three GEMMs of 2·tokens·k·n FLOPs in a training step: forward, input gradient,
    weight gradient."""
    factors = []
    for p in shape.projections(mode):
        factors += [(p.d_in, p.d_out)] if p.rank is None else [(p.d_in, p.rank),
                                                              (p.rank, p.d_out)]
    return factors


def projection_training_flops(shape, mode: str, tokens: int) -> float:
    """Training FLOPs of the layer's projections: 3 × forward (Projection.flops_per_token)."""
    return 3.0 * tokens * sum(p.flops_per_token for p in shape.projections(mode))


def stage_layers(plan: Plan, work: Path) -> None:
    from megatron_boost.analysis.flops import peak_tflops
    from megatron_boost.analysis.shape import ModelShape

    _setup(plan)
    peak = peak_tflops(None, plan.device)
    for name in plan.layer_models:
        cfg = _load(f"configs/{name}.yaml", [], plan.device)
        shape = ModelShape.from_config(cfg, name)
        for tp in plan.layer_tps:
            for mode in MODES:
                case = f"{name} tp={tp} {mode} (one rank)"
                try:
                    _layer_case(plan, case, rank_local_shape(shape, mode, tp), mode, peak)
                except Exception as err:
                    check(7, case, False, one_line(err))
                _free(plan.device)


def _gemm_ms(plan: Plan, factors: List[Tuple[int, int]], tokens: int, dtype) -> float:
    """Device milliseconds of the forward, input-gradient and weight-gradient GEMMs of every
    factor, in the layouts of a linear layer (weight [n, k])."""
    import torch

    operands = []
    for k, n in factors:
        operands.append((torch.randn(tokens, k, device=plan.device, dtype=dtype),
                         torch.randn(n, k, device=plan.device, dtype=dtype),
                         torch.randn(tokens, n, device=plan.device, dtype=dtype)))

    def gemms():
        for x, w, g in operands:
            torch.mm(x, w.t())  # forward [T, k] x [k, n]
            torch.mm(g, w)  # input gradient [T, n] x [n, k]
            torch.mm(g.t(), x)  # weight gradient [n, T] x [T, k]

    return DeviceTimer(plan.device).median_ms(gemms, plan.timing_iters)


def _layer_case(plan: Plan, case: str, local, mode: str, peak: Optional[float]) -> None:
    import torch

    from megatron_boost.analysis.comm import build_decoder_layer

    seq, mbs = plan.layer_tokens
    tokens = seq * mbs
    overrides = [*shape_overrides(local), f"model.seq_length={seq}"]
    cfg_file = f"configs/{local.name}.yaml"
    _, config = _layer_config(cfg_file, overrides, mode, "sdpa", plan.device)
    layer = build_decoder_layer(config).to(plan.device)
    x = torch.randn(seq, mbs, config.hidden_size, device=plan.device,
                    dtype=config.params_dtype, requires_grad=True)  # [s, b, d (boost: d/t)]

    def step():
        out = layer(x, attention_mask=None)[0]
        out.backward(torch.ones_like(out))

    timer = DeviceTimer(plan.device)
    layer_ms = timer.median_ms(step, plan.timing_iters)
    del layer, x
    gemm_ms = _gemm_ms(plan, projection_gemms(local, mode), tokens, config.params_dtype)
    tflops = projection_training_flops(local, mode, tokens) / (gemm_ms * 1e-3) / 1e12
    frac = "" if peak is None else f" ({100 * tflops / peak:.0f}% of peak)"
    ok = all(math.isfinite(v) and v > 0 for v in (layer_ms, gemm_ms, tflops))
    check(7, case, ok, f"layer fwd+bwd {layer_ms:.2f} ms | its projection GEMMs alone "
                       f"{gemm_ms:.2f} ms "
                       f"= {tflops:.3g} TFLOP/s{frac} | GEMMs / layer "
                       f"{100 * gemm_ms / layer_ms:.0f}% | d={local.hidden} f={local.ffn} "
                       f"h={local.heads} r={local.r_attn}")


# ---------------------------------------------------------------------------------------------
# driver: one subprocess per stage
# ---------------------------------------------------------------------------------------------

STAGES: Dict[int, Callable[[Plan, Path], None]] = {
    0: stage_environment, 1: stage_steps, 2: stage_resume, 3: stage_equivalence,
    4: stage_host_syncs, 5: stage_throughput, 6: stage_attention, 7: stage_layers}


def _stage_env(stage: int) -> Dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if stage == 2:
        env.update(DETERMINISTIC_ENV)
    return env


def run_stage(stage: int, plan: Plan, work: Path) -> int:
    """The body of one stage's subprocess: its rows on stdout; 0 when none failed."""
    if os.environ.get(FAIL_STAGE_ENV) == str(stage):
        check(stage, "stage", False, f"made to fail by {FAIL_STAGE_ENV}={stage}")
        return 1
    if os.environ.get(HANG_STAGE_ENV) == str(stage):
        time.sleep(3600)
    try:
        STAGES[stage](plan, work)
    except Exception as err:
        traceback.print_exc()  # to the stage's log
        check(stage, "stage", False, one_line(err))
    return 1 if _failed_rows[0] else 0


@dataclass
class StageResult:
    stage: int
    status: str  # ok | FAIL | TIMEOUT | SKIPPED
    seconds: float
    reason: str = ""


def _last_log_line(log: Path) -> str:
    lines = [l for l in log.read_text(errors="replace").splitlines() if l.strip()] \
        if log.exists() else []
    return lines[-1].strip()[:200] if lines else "no output"


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill a stage's process group (the stage and anything it started) and reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


#: While a stage is being started, SIGTERM only marks itself pending (launch_stage raises it
#: once the stage's handle exists).
_termination = {"deferred": False, "pending": False}


def _terminate(signum, frame):
    """SIGTERM (e.g. an outer ``timeout``) as an exception, so the running stage is killed."""
    if _termination["deferred"]:
        _termination["pending"] = True
        return
    raise SystemExit(128 + signum)


def launch_stage(stage: int, args: argparse.Namespace, work: Path, limit: float) -> StageResult:
    """Run one stage in its own process group; kill the group after ``limit`` seconds."""
    log = work / f"stage{stage}.log"
    cmd = [sys.executable, "-m", "megatron_boost.cli.gpu_check", "--run-stage", str(stage),
           "--workdir", str(work)] + (["--cpu"] if args.cpu else [])
    t0 = time.perf_counter()
    with open(log, "w") as err:
        _termination["deferred"] = True  # until the stage's handle exists to kill it by
        try:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=_stage_env(stage), stderr=err,
                                    start_new_session=True)
        finally:
            _termination["deferred"] = False
        try:
            if _termination["pending"]:
                raise SystemExit(128 + signal.SIGTERM)
            rc = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return StageResult(stage, "TIMEOUT", time.perf_counter() - t0,
                               f"killed after its limit of {limit:.0f} s; log {log}")
        except BaseException:  # Ctrl-C, or SIGTERM (_terminate): no stage outlives the check
            _kill_group(proc)
            raise
    seconds = time.perf_counter() - t0
    with contextlib.suppress(ProcessLookupError):  # leftovers (e.g. checkpoint writers)
        os.killpg(proc.pid, signal.SIGKILL)
    if rc == 0:
        return StageResult(stage, "ok", seconds)
    if rc == 1:
        return StageResult(stage, "FAIL", seconds, f"a row failed; log {log}")
    return StageResult(stage, "FAIL", seconds,
                       f"exit {rc}: {_last_log_line(log)}; log {log}")


def parse_stages(text: str) -> List[int]:
    try:
        stages = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        stages = [-1]
    if not stages or any(s not in STAGES for s in stages):
        raise ValueError(f"--stages {text!r} must be a comma-separated list of stage numbers "
                         f"0-{max(STAGES)} (e.g. --stages 0,3)")
    return stages


def parse_limits(items: Sequence[str]) -> Dict[int, float]:
    limits = {}
    for item in items:
        stage, _, seconds = item.partition("=")
        try:
            limits[int(stage)] = float(seconds)
        except ValueError:
            raise ValueError(f"--time-limit {item!r} must look like STAGE=SECONDS "
                             f"(e.g. --time-limit 5=120)") from None
    return limits


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu_check", description="Readiness check of one CUDA GPU as stages, each in "
        "its own process with its own time limit (docs/gpu.md).")
    parser.add_argument("--cpu", action="store_true",
                        help="run every stage on the CPU at tiny shapes (the suite's dry run)")
    parser.add_argument("--stages", default=",".join(map(str, STAGES)),
                        help="comma-separated stage numbers (default: all, 0-7)")
    parser.add_argument("--time-limit", action="append", default=[], metavar="STAGE=SECONDS",
                        help="override one stage's time limit (repeatable)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds for the whole check (default: 470 on the GPU)")
    parser.add_argument("--workdir", help="keep runs and stage logs here (default: a temporary "
                        "directory, kept when a stage fails)")
    parser.add_argument("--run-stage", type=int, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def print_summary(results: List[StageResult], total: float) -> None:
    print("stage times: " + " | ".join(f"{r.stage} {STAGE_NAMES[r.stage]} {r.seconds:.1f} s"
                                       for r in results) + f" | total {total:.1f} s", flush=True)
    failed = [r for r in results if r.status != "ok"]
    print(f"gpu_check: {len(results) - len(failed)}/{len(results)} stages ok"
          + ("" if not failed else "; not ok: " + ", ".join(f"{r.stage} ({r.status})"
                                                            for r in failed)), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = cpu_plan() if args.cpu else gpu_plan()
    if args.run_stage is not None:
        return run_stage(args.run_stage, plan, Path(args.workdir))
    try:
        stages = parse_stages(args.stages)
        plan.limits.update(parse_limits(args.time_limit))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    deadline = args.deadline or plan.deadline
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"gpu_check on {plan.device}: stages {','.join(map(str, stages))}, deadline "
          f"{deadline:.0f} s, logs in {work}", flush=True)
    signal.signal(signal.SIGTERM, _terminate)
    t0 = time.perf_counter()
    results = []
    for stage in stages:
        left = deadline - (time.perf_counter() - t0)
        if left < 5:
            result = StageResult(stage, "SKIPPED", 0.0, f"no time left of the {deadline:.0f} "
                                                        f"s deadline")
        else:
            result = launch_stage(stage, args, work, min(plan.limits[stage], left))
        results.append(result)
        print(format_row(Row(stage, "-- stage --", result.status,
                             f"{result.seconds:.1f} s" + (f" | {result.reason}"
                                                          if result.reason else ""))),
              flush=True)
    print_summary(results, time.perf_counter() - t0)
    ok = all(r.status == "ok" for r in results)
    if ok and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
