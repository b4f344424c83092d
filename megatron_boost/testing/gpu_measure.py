"""The measuring stages of the GPU check (``tools/gpu_check.sh``, docs/gpu.md), each a
function ``stage(plan, work)`` run in a process of its own:

5. throughput and MFU at cola-350m shapes, TP=1, boost and full rank (explicit budget).
6. one decoder layer at s=8192 per attention backend: time, saved activations, peak memory;
   out-of-memory is a reported row.
7. per-rank layer shapes of cola-1b / cola-7b at TP=1/2/4 (``analysis/rank_shape.py``; a
   layout the trainer refuses is a row saying why): layer time, and the projection GEMMs of the
   analytic shape timed with device events (``perf/timing.py``); FLOPs from the shape; beside
   each, the op ledger of the same layer (kernels, element-wise traffic, copies, saved bytes)
   and the kernels the profiler counted on the GPU.
"""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path
from typing import Iterable, Optional, Sequence

from megatron_boost.analysis.rank_shape import (projection_gemms, projection_training_flops,
                                               rank_layout_problem, rank_local_shape,
                                               shape_overrides)
from megatron_boost.config.modes import TPMode
from megatron_boost.runtime.stages import Row, check, emit, info, one_line
from megatron_boost.testing.gpu_stages import (BACKENDS, MODES, Case, Plan,
                                               backend_unavailable, build_trainable,
                                               fail_row, load_config, run_cases, setup_stage,
                                               synchronize, te_unavailable_reason, train_once)

__all__ = ["stage_throughput", "stage_attention", "stage_layers"]


# ---------------------------------------------------------------------------------------------
# stage 5: throughput and MFU
# ---------------------------------------------------------------------------------------------


def stage_throughput(plan: Plan, work: Path) -> None:
    setup_stage(plan)
    run_cases(5, (Case(f"cola-350m {mode}", functools.partial(_throughput_case, plan, mode))
                  for mode in (TPMode.BOOST, TPMode.FULL)), plan.device)


def _throughput_case(plan: Plan, mode: TPMode) -> None:
    import torch

    from megatron_boost.analysis.flops import flops_per_token
    from megatron_boost.runtime.devices import peak_tflops
    from megatron_boost.config.validation import train_iterations
    from megatron_boost.config.resolved import padded_vocab_size

    cfg = load_config("configs/cola-350m.yaml",
                      [*plan.throughput_overrides, f"parallel.mode={mode}"], plan.device)
    steps = train_iterations(cfg)  # the explicit budget: configs/cola-350m.yaml has tokens
    if steps <= plan.warmup_steps:
        raise ValueError(f"budget of {steps} steps leaves none after {plan.warmup_steps} "
                         f"warm-up steps")
    tr = build_trainable(cfg, "bf16", plan.device)
    losses = [train_once(tr)["loss"] for _ in range(plan.warmup_steps)]
    if plan.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    synchronize(plan.device)
    t0 = time.perf_counter()
    for _ in range(steps - plan.warmup_steps):
        losses.append(train_once(tr)["loss"])
    synchronize(plan.device)
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

    cfg = load_config(config_file, [*overrides, "model.num_layers=1", "parallel.tp=1",
                                    f"parallel.mode={mode}",
                                    f"model.attention_backend={backend}"], device)
    run = resolve_run(cfg, device, vocab_size=cfg.model.vocab_size).with_precision(precision)
    return cfg, to_transformer_config(run, perform_initialization=False)


def stage_attention(plan: Plan, work: Path) -> None:
    setup_stage(plan)
    run_cases(6, _attention_cases(plan, te_unavailable_reason(plan.device)), plan.device,
              error_row=_oom_or_fail_row)


def _attention_cases(plan: Plan, te_why: Optional[str]) -> Iterable[Case]:
    for backend in BACKENDS:
        case = f"{plan.attention_model} boost layer s={plan.attention_seq} {backend}"
        yield Case(case, functools.partial(_attention_case, plan, case, backend),
                   backend_unavailable(backend, te_why))


def _oom_or_fail_row(stage: int, case: str, err: BaseException) -> None:
    """Out of memory at a long sequence is a measurement (an info row), not a failure."""
    if _is_oom(err):
        emit(Row(stage, case, "info", f"out of memory: {one_line(err)[:160]}"))
    else:
        fail_row(stage, case, err)


def _is_oom(err: BaseException) -> bool:
    import torch

    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower()


def _attention_case(plan: Plan, case: str, backend: str) -> None:
    import torch

    from megatron_boost.measure.layer_comm import build_decoder_layer
    from megatron_boost.measure.memory import SavedActivations
    from megatron_boost.perf.timing import DeviceTimer

    _, config = _layer_config(f"configs/{plan.attention_model}.yaml",
                              [f"model.seq_length={plan.attention_seq}"], TPMode.BOOST, backend,
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


def stage_layers(plan: Plan, work: Path) -> None:
    from megatron_boost.runtime.devices import peak_tflops
    from megatron_boost.config.shape import ModelShape

    setup_stage(plan)
    peak = peak_tflops(None, plan.device)
    fuser_check(7, plan.device == "cuda")
    for name in plan.layer_models:
        shape = ModelShape.from_config(load_config(f"configs/{name}.yaml", [], plan.device), name)
        run_cases(7, _layer_cases(plan, shape, peak), plan.device)


def fuser_check(stage: int, on_cuda: bool, jit_fuser=None, env=None, ledger=None) -> bool:
    """The profiler stage's row on megatron's jit_fuser: FAIL on a CUDA run where it does not
    compile (``measure/fusion_check.py``: every fused region would run as its eager
    kernels, which the op ledger's counts leave out), with the layer's cost; n/a on the CPU,
    where the regions run eagerly by design. ``jit_fuser`` and ``env``: megatron's and this
    process's by default (a test passes its own)."""
    from megatron_boost.measure.fusion_check import fuser_notice, jit_fuser_problem

    if not on_cuda:
        emit(Row(stage, "jit_fuser", "n/a", "no GPU: the fused regions compile on CUDA only"))
        return True
    problem = jit_fuser_problem(jit_fuser, env)
    ok = problem is None
    check(stage, "jit_fuser", ok,
          "megatron's jit_fuser compiles (torch.compile)" if ok else fuser_notice(problem, ledger))
    return ok


def _layer_cases(plan: Plan, shape, peak: Optional[float]) -> Iterable[Case]:
    _measure_ledgers(plan, shape)
    for tp in plan.layer_tps:
        for mode in MODES:
            case = f"{shape.name} tp={tp} {mode} (one rank)"
            refused = rank_layout_problem(shape, mode, tp)
            if refused is not None:  # the trainer's own rule: no floor-divided shape
                yield Case(case, None, f"layout refused: {refused}")
                continue
            yield Case(case, functools.partial(_layer_case, plan, case, shape, tp, mode, peak))


def _layer_case(plan: Plan, case: str, shape, tp: int, mode: str,
                peak: Optional[float]) -> None:
    import torch
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_boost.measure.layer_comm import build_decoder_layer
    from megatron_boost.perf.timing import DeviceTimer, projection_gemm_ms

    local = rank_local_shape(shape, mode, tp)
    seq, mbs = plan.layer_tokens
    tokens = seq * mbs
    overrides = [*shape_overrides(local), f"model.seq_length={seq}"]
    cfg_file = f"configs/{local.name}.yaml"
    _, config = _layer_config(cfg_file, overrides, mode, "sdpa", plan.device)
    layer = build_decoder_layer(config).to(plan.device)
    x = torch.randn(seq, mbs, config.hidden_size, device=plan.device,
                    dtype=config.params_dtype, requires_grad=True)  # [s, b, d (boost: d/t)]
    rope = RotaryEmbedding(kv_channels=config.kv_channels, rotary_percent=1.0,
                           use_cpu_initialization=True)(seq).to(plan.device)  # as GPTModel's

    def step():
        out = layer(x, attention_mask=None, rotary_pos_emb=rope)[0]
        out.backward(torch.ones_like(out))

    timer = DeviceTimer(plan.device)
    layer_ms = timer.median_ms(step, plan.timing_iters)
    launched = _device_kernels(step, plan.device)
    del layer, x
    gemm_ms = projection_gemm_ms(plan.device, projection_gemms(local, mode), tokens,
                                 config.params_dtype, plan.timing_iters)
    tflops = projection_training_flops(local, mode, tokens) / (gemm_ms * 1e-3) / 1e12
    frac = "" if peak is None else f" ({100 * tflops / peak:.0f}% of peak)"
    ok = all(math.isfinite(v) and v > 0 for v in (layer_ms, gemm_ms, tflops))
    check(7, case, ok, f"layer fwd+bwd {layer_ms:.2f} ms | its projection GEMMs alone "
                       f"{gemm_ms:.2f} ms "
                       f"= {tflops:.3g} TFLOP/s{frac} | GEMMs / layer "
                       f"{100 * gemm_ms / layer_ms:.0f}% | d={local.hidden} f={local.ffn} "
                       f"h={local.heads} r={local.r_attn}")
    info(7, case, _ledger_line(local, mode, plan, config, launched))


def _device_kernels(step, device: str) -> Optional[int]:
    """Kernels one ``step`` launches on the GPU (torch's profiler, CUDA activity); None on the
    CPU, which launches none."""
    import torch

    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _ledger_spec(local, mode: str, plan: Plan, bf16: bool):
    from megatron_boost.config.layout import Layout
    from megatron_boost.measure.ledger import LedgerSpec

    seq, mbs = plan.layer_tokens
    return LedgerSpec(shape=local, layout=Layout(mode=mode, tp=1), micro_batch=mbs, seq_length=seq,
                      dtype="bf16" if bf16 else "fp32")


def _measure_ledgers(plan: Plan, shape) -> None:
    """Every case's op ledger up front, in one child process (this one has a process
    group); the cases then read them from the cache."""
    from megatron_boost.measure.ledger import measure_ledgers

    bf16 = True  # the precision _layer_config gives stage 7
    measure_ledgers([_ledger_spec(rank_local_shape(shape, mode, tp), mode, plan, bf16)
                     for tp in plan.layer_tps for mode in MODES
                     if rank_layout_problem(shape, mode, tp) is None])


def _ledger_line(local, mode: str, plan: Plan, config, launched: Optional[int]) -> str:
    """The op ledger of the same layer (docs/design.md §17) beside what the GPU measured: its
    kernel count against the profiler's, and its element-wise traffic (the time it takes at
    the device's measured bandwidth is the first GPU run's to read off the layer time)."""
    from megatron_boost.measure.ledger import layer_ledger

    ledger = layer_ledger(_ledger_spec(local, mode, plan, config.bf16))
    measured = "n/a (no GPU)" if launched is None else str(launched)
    return (f"op ledger: {ledger.count()} kernels (profiler: {measured}), "
            f"{ledger.traffic() / 1e6:.1f} MB element-wise + copy, "
            f"{len(ledger.layout_copies())} layout copies outside attention, "
            f"saved {ledger.saved_bytes / 2 ** 20:.1f} MiB")
