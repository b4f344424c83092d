"""One-command readiness check of a single CUDA GPU (``tools/gpu_check.sh``), ONE summary table.

    tools/gpu_check.sh            # one CUDA GPU, about 5 minutes on an H100/H200
    tools/gpu_check.sh --cpu      # dry run of every step on the CPU with tiny shapes

(a) smoke: the real ``pretrain_lowrank.py`` under torchrun (one process; NCCL and bf16 on the
    GPU), distributed optimizer on, 6 iterations with a checkpoint at 3; a second run resumes
    from iteration 3 and must reproduce iterations 4-6 exactly.
(b) throughput: 50 steps of ``configs/cola-350m.yaml`` at seq 2048 (mock data, TP=1) in boost
    and full mode; tokens/s, MFU and peak memory of the last logged window, read from the
    ``metrics.jsonl`` the trainer writes.
(c) layers: one decoder layer per mode at the CoLA-1B and CoLA-7B shapes and at the per-rank
    shapes of CoLA-7B at TP=2 and TP=4 (the GEMMs one rank runs, without the collectives; see
    :func:`rank_local_model`): fwd+bwd time; GEMM FLOPs (``FlopCounterMode``) over GEMM time
    (``torch.profiler``) as achieved TFLOP/s and as a fraction of the device's peak
    (``megatron_boost.runtime.devices``); the GEMMs' share of the device time.
(d) attention: megatron's local DotProductAttention against SDPAttention on the same inputs:
    fwd+bwd time, bytes saved for backward, peak device memory, and their difference.

Exit status 1 when a check fails (the smoke resume, or a non-finite or missing measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[2]
ENTRY = ROOT / "pretrain_lowrank.py"

#: aten ops whose kernels are GEMMs (their self device time is the GEMM time).
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
MODES = ("full", "naive", "boost")


@dataclass
class Plan:
    """Sizes of every step; :func:`gpu_plan` or :func:`cpu_plan`."""

    device: str
    dtype: str
    throughput_config: str
    throughput_overrides: List[str]
    layer_shapes: Dict[str, Dict[str, int]]
    layer_cases: List[Tuple[str, int]]
    layer_tokens: Tuple[int, int]  # (seq, micro-batch)
    attention: Dict[str, int]
    iters: int = 10


@dataclass
class Row:
    check: str
    case: str
    result: str
    ok: Optional[bool] = None  # None: a measurement, not a pass/fail check


def _shape(d, f, h, r) -> Dict[str, int]:
    return dict(hidden_size=d, ffn_hidden_size=f, num_attention_heads=h, attn_rank=r,
                mlp_rank=r)


def gpu_plan() -> Plan:
    return Plan(
        device="cuda", dtype="bf16", throughput_config="configs/cola-350m.yaml",
        throughput_overrides=["model.seq_length=2048", "training.micro_batch_size=4",
                              "training.global_batch_size=4", "training.train_iters=50",
                              "logging.log_interval=10"],
        layer_shapes={"cola-1b": _shape(2048, 5461, 32, 512),
                      "cola-7b": _shape(4096, 11008, 32, 1024)},
        layer_cases=[("cola-1b", 1), ("cola-7b", 1), ("cola-7b", 2), ("cola-7b", 4)],
        layer_tokens=(2048, 4), attention=dict(seq=2048, batch=4, heads=32, head_dim=128))


def cpu_plan() -> Plan:
    return Plan(
        device="cpu", dtype="fp32", throughput_config="configs/debug.yaml",
        throughput_overrides=["training.train_iters=3", "logging.log_interval=3"],
        layer_shapes={"tiny": _shape(64, 128, 4, 16)}, layer_cases=[("tiny", 1), ("tiny", 2)],
        layer_tokens=(32, 2), attention=dict(seq=64, batch=2, heads=4, head_dim=16), iters=2)


# ---------------------------------------------------------------------------------------------
# (a), (b): the real trainer
# ---------------------------------------------------------------------------------------------


def _train(plan: Plan, config: str, run_dir: Path, overrides: List[str]) -> Dict[int, dict]:
    """Run pretrain_lowrank.py under torchrun (one process); its metrics.jsonl by iteration."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           str(ENTRY), "--config", str(ROOT / config), f"training.device={plan.device}",
           "training.precision=bf16", "data.mock=true", "data.tokenizer_model=",
           "parallel.tp=1", "logging.tensorboard=false",
           f"logging.run_dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"training failed (exit {proc.returncode}): {' '.join(cmd)}\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["iteration"]: r for r in map(json.loads, filter(str.strip, lines))}


def smoke_resume(plan: Plan, work: Path) -> List[Row]:
    """(a) bf16 + distributed optimizer: train 6, resume from 3, compare iterations 4-6."""
    common = ["parallel.use_distributed_optimizer=true", "training.train_iters=6",
              "checkpoint.save_interval=3", "training.eval_interval=100",
              "logging.log_interval=1"]
    ref = _train(plan, "configs/debug.yaml", work / "smoke", common)
    ckpt = work / "smoke" / "checkpoints" / "iter_0000003"
    got = _train(plan, "configs/debug.yaml", work / "smoke_resumed",
                 common + [f"checkpoint.load={ckpt}"])
    diffs = [abs(got[i]["loss"] - ref[i]["loss"]) for i in (4, 5, 6)]
    return [Row("a smoke", f"bf16 {plan.device} dist-opt save/resume",
                f"loss it 6 {ref[6]['loss']:.4f}; resumed 4-6 max |diff| {max(diffs):.1e}",
                ok=max(diffs) == 0.0)]


def throughput(plan: Plan, work: Path) -> List[Row]:
    """(b) tokens/s, MFU and peak memory of the last logged window, boost and full."""
    rows = []
    for mode in ("boost", "full"):
        recs = _train(plan, plan.throughput_config, work / f"throughput_{mode}",
                      plan.throughput_overrides + [f"parallel.mode={mode}",
                                                   "training.eval_iters=0"])
        last = recs[max(recs)]
        mfu = "n/a" if last["mfu"] is None else f"{100 * last['mfu']:.1f}%"
        rows.append(Row("b throughput", f"{Path(plan.throughput_config).stem} {mode}",
                        f"{last['tokens_per_s']:,.0f} tok/s | MFU {mfu} | peak mem "
                        f"{last['peak_mem_bytes'] / 2**30:.2f} GiB",
                        ok=last["tokens_per_s"] > 0))
    return rows


# ---------------------------------------------------------------------------------------------
# (c) one decoder layer per mode
# ---------------------------------------------------------------------------------------------


def rank_local_model(shape: Dict[str, int], mode: str, tp: int) -> Dict[str, int]:
    """The one-process layer whose GEMMs are those of one rank at tensor parallelism ``tp``
    (docs/design.md §2): full shards heads and ffn; naive shards the bottleneck ranks
    (attention, the MLP activation and the norms are replicated); boost shards the hidden
    stream, heads and ffn, and keeps the full ranks (its A GEMMs reduce d/t-wide inputs)."""
    d, f, h = shape["hidden_size"], shape["ffn_hidden_size"], shape["num_attention_heads"]
    r = shape["attn_rank"]
    local = dict(shape, kv_channels=d // h)
    if mode == "full":
        local.update(ffn_hidden_size=f // tp, num_attention_heads=h // tp)
    elif mode == "naive":
        local.update(attn_rank=r // tp, mlp_rank=shape["mlp_rank"] // tp)
    else:
        local.update(hidden_size=d // tp, ffn_hidden_size=f // tp, num_attention_heads=h // tp)
    return local


def _transformer_config(model: Dict[str, int], mode: str, dtype: str):
    import torch

    from megatron_boost.config.run import load_run_config, to_transformer_config

    overrides = [f"model.{k}={v}" for k, v in model.items()] + [f"parallel.mode={mode}"]
    cfg = load_run_config(None, overrides + ["model.num_layers=1"])
    return to_transformer_config(
        cfg, torch.bfloat16 if dtype == "bf16" else torch.float32)


def _synchronize(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], None], iters: int, device: str) -> float:
    """Median seconds of ``fn`` over ``iters`` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(iters):
        _synchronize(device)
        t0 = time.perf_counter()
        fn()
        _synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _gemm_flops(fn: Callable[[], None]) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    counts = counter.get_flop_counts().get("Global", {})
    return float(sum(v for op, v in counts.items() if f"aten::{op.__name__}"
                     in GEMM_OPS))


def _gemm_time_share(fn: Callable[[], None], device: str) -> Tuple[float, float]:
    """(seconds in GEMM kernels, their share of all device time) of one run of ``fn``."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        _synchronize(device)
    attr = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    total = sum(getattr(e, attr) for e in events)
    gemm = sum(getattr(e, attr) for e in events if e.key in GEMM_OPS)
    return gemm * 1e-6, gemm / total if total else float("nan")


def profile_layer(plan: Plan, model: Dict[str, int], mode: str) -> Dict[str, float]:
    """fwd+bwd of one decoder layer: time, GEMM TFLOP/s, GEMM share of device time."""
    import torch

    from megatron_boost.analysis.comm import build_decoder_layer

    config = _transformer_config(model, mode, plan.dtype)
    layer = build_decoder_layer(config).to(plan.device)
    seq, mbs = plan.layer_tokens
    x = torch.randn(seq, mbs, config.hidden_size, device=plan.device,
                    dtype=config.params_dtype, requires_grad=True)  # [s, b, d(/t)]

    def step():
        out = layer(x, attention_mask=None)[0]
        out.backward(torch.ones_like(out))

    seconds = _timed(step, plan.iters, plan.device)
    flops = _gemm_flops(step)
    gemm_s, share = _gemm_time_share(step, plan.device)
    return {"seconds": seconds, "gemm_tflops": flops / gemm_s / 1e12 if gemm_s else math.nan,
            "gemm_share": share}


def layer_rows(plan: Plan, peak: Optional[float]) -> List[Row]:
    rows = []
    for name, tp in plan.layer_cases:
        for mode in MODES:
            local = rank_local_model(plan.layer_shapes[name], mode, tp)
            m = profile_layer(plan, local, mode)
            frac = "n/a" if peak is None else f"{100 * m['gemm_tflops'] / peak:.0f}% of peak"
            rows.append(Row("c layer", f"{name} tp={tp} {mode}",
                            f"{1e3 * m['seconds']:.2f} ms fwd+bwd | GEMM "
                            f"{m['gemm_tflops']:.3g} TFLOP/s ({frac}) | GEMM share "
                            f"{100 * m['gemm_share']:.0f}%",
                            ok=all(math.isfinite(v) for v in m.values())))
    return rows


# ---------------------------------------------------------------------------------------------
# (d) local vs sdpa attention
# ---------------------------------------------------------------------------------------------


def _attention_run(plan: Plan, cls) -> Tuple[float, int, int, "object"]:
    """(seconds fwd+bwd, bytes saved for backward, peak device bytes, output) of one module."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_boost.analysis.memory import SavedActivations

    a = plan.attention
    model = _shape(a["heads"] * a["head_dim"], 4 * a["heads"], a["heads"], 16)
    config = _transformer_config(model, "full", plan.dtype)
    attn = cls(config, 1, AttnMaskType.causal, "self").to(plan.device)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(a["seq"], a["batch"], a["heads"], a["head_dim"], generator=gen)
               .to(plan.device, config.params_dtype).requires_grad_() for _ in range(3))

    def step():
        attn(q, k, v, None).sum().backward()

    seconds = _timed(step, plan.iters, plan.device)
    with SavedActivations() as saved:
        out = attn(q, k, v, None)
    del out
    peak = 0
    if plan.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        peak = torch.cuda.max_memory_allocated() - base
    return seconds, saved.bytes, peak, attn(q, k, v, None).detach().float()


def attention_rows(plan: Plan) -> List[Row]:
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_boost.model.attention import SDPAttention

    runs = {name: _attention_run(plan, cls)
            for name, cls in (("local", DotProductAttention), ("sdpa", SDPAttention))}
    ref = runs["local"][3]
    rows = []
    a = plan.attention
    for name, (seconds, saved, peak, out) in runs.items():
        rel = float((out - ref).abs().max() / ref.abs().max())
        rows.append(Row("d attention", f"{name} s={a['seq']} b={a['batch']} h={a['heads']}",
                        f"{1e3 * seconds:.2f} ms fwd+bwd | saved {saved / 2**20:.1f} MiB | "
                        f"peak {peak / 2**20:.1f} MiB | max rel diff vs local {rel:.1e}",
                        ok=math.isfinite(rel) and rel < (3e-2 if plan.dtype == "bf16" else 1e-4)))
    return rows


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------


def _init_one_process(device: str) -> Optional[float]:
    """World of one for the in-process layer checks; returns the device's peak TFLOP/s."""
    from megatron_boost.runtime.cpu_mode import maybe_use_cpu
    from megatron_boost.runtime.devices import peak_dense_bf16_tflops
    from megatron_boost.train.distributed import init_distributed
    from megatron_boost.train.resilience import process_group_timeout
    from megatron_boost.train.step import initialize_parallel

    maybe_use_cpu(device)
    init_distributed(device, process_group_timeout(30.0))  # the trainer's default
    initialize_parallel(1, 1, None, seed=1234)
    if device != "cuda":
        return None
    import torch

    return peak_dense_bf16_tflops(torch.cuda.get_device_name())


def print_table(rows: List[Row]) -> None:
    widths = [max(len(getattr(r, f)) for r in rows) for f in ("check", "case")]
    print(f"{'check':<{widths[0]}}  {'case':<{widths[1]}}  status  result")
    for r in rows:
        status = {True: "ok", False: "FAIL", None: "-"}[r.ok]
        print(f"{r.check:<{widths[0]}}  {r.case:<{widths[1]}}  {status:<6}  {r.result}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu_check", description="Readiness check of one CUDA GPU: smoke resume, "
        "throughput, per-layer GEMM efficiency, local vs sdpa attention; one table.")
    parser.add_argument("--cpu", action="store_true",
                        help="dry run of every step on the CPU with tiny shapes")
    parser.add_argument("--workdir", help="keep the runs here (default: a temporary dir)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    plan = cpu_plan() if args.cpu else gpu_plan()
    with contextlib.ExitStack() as stack:
        work = Path(args.workdir or stack.enter_context(tempfile.TemporaryDirectory()))
        rows = smoke_resume(plan, work) + throughput(plan, work)
        peak = _init_one_process(plan.device)
        rows += layer_rows(plan, peak) + attention_rows(plan)
    print_table(rows)
    return 1 if any(r.ok is False for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
