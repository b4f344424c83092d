"""Training-step benchmark of full, naive and boost on the same work, on CPU (gloo).

    megatron-boost-benchmark --config configs/bench-cpu.yaml --tp 2 \\
        --modes full,full+sp,naive,boost --steps 10 --warmup 2 --single --json bench.json

Spawns tp·pp gloo processes (one thread each) and builds, in every process, one model per
mode from the same config and seed: ``full`` is the full-rank twin (the same config with
parallel.mode=full: the same d, f, heads, layers; ranks ignored) as the BOOST paper measured
it (all-reduce TP, parallel.sequence_parallel=false), ``full+sp`` the same twin as megatron
users run it (sequence parallelism on: norms and dropout sharded along the sequence, each TP
all-reduce a reduce-scatter + all-gather), ``full+swiglu`` the paper's baseline with
megatron's fused SwiGLU (``model.bias_activation_fusion``: a CUDA run's default; here its
jit_fuser compiles it with torch's inductor in every process), ``naive`` and ``boost`` the
bottleneck model under vanilla and bottleneck-aware TP. Each step is one optimizer step of
megatron-core's schedule, DDP and Adam (``megatron_boost.train.step.train_step``) over
global_batch_size / micro_batch_size micro-batches of synthetic tokens (no data files). The
modes' steps are interleaved (step i of every mode before step i + 1 of any), so a change in
machine load hits all modes alike. After ``--warmup`` untimed steps, ``--steps`` steps are
timed with ``time.perf_counter`` between two barriers. Then, untimed:

* TP comm bytes/step: every collective on the TP group during one more step
  (``record_collectives``; forward and backward, including the head and the loss);
* saved activation bytes: tensors autograd saves during ONE micro-batch forward (per rank,
  parameters excluded; ``measure.memory.SavedActivations``);
* FLOPs/step: analytic model FLOPs (matmuls; ``analysis.flops.step_flops``; naive and boost have the
  same model FLOPs), achieved FLOP/s = FLOPs/step ÷ median step time over the whole TP group,
  and the per-rank executed FLOPs (naive duplicates the attention core on every TP rank).

``--single`` adds a row: the bottleneck model (boost code at TP=1) in ONE process with 2 threads,
the physical limit of a 2-core machine. ``--recompute`` none / selective / full are megatron-core's
recompute options (training.recompute); ``lowrank`` is passed through as training.recompute=lowrank
and reported as unavailable where the config rejects it.

Targets at TP=2 (printed, never enforced): boost ≥ 1.9x faster than naive, ≥ 1.7x faster than
full (the paper's baseline), and within 10 % of the single-process row. The ratios also
report boost against ``full+sp``, ``full+swiglu`` and against the fastest of the full-rank
rows. Exit code 0 unless something failed to run.
"""

from __future__ import annotations

import argparse

from megatron_boost.cli.arg_types import (bench_mode_list, non_negative_int, output_file,
                                          positive_int)
import copy
import gc
import json
import os
import statistics
import sys
import time

from megatron_boost.cli.errors import one_line_errors
from megatron_boost.cli.mode_labels import FULL_SP, FULL_SWIGLU, label_of, layout_of, mode_of
from megatron_boost.config.modes import TPMode

TARGETS = {"boost_vs_naive": 1.9, "boost_vs_full": 1.7, "single_within": 0.10}


# ---------------------------------------------------------------------------------------------
# worker (runs in every spawned process)
# ---------------------------------------------------------------------------------------------


def _system_busy_s() -> float:
    """CPU seconds all processes of the machine have used (Linux /proc/stat), or nan."""
    try:
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:]]
        # user nice system idle iowait irq softirq steal ...
        busy = f[0] + f[1] + f[2] + f[5] + f[6] + (f[7] if len(f) > 7 else 0)
        return busy / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return float("nan")


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def apply_bench_layout(cfg, name: str) -> None:
    """Set the config's mode, sequence parallelism and fused SwiGLU for a benchmark mode label
    (cli/mode_labels.py): ``full`` is the BOOST paper's baseline (no sequence parallelism),
    ``full+sp`` megatron's, ``full+swiglu`` the paper's with megatron's fused SwiGLU (on by
    default on CUDA; on the CPU its jit_fuser compiles it with inductor); the bottleneck modes
    keep the config's resolution (off)."""
    layout = layout_of(name)
    cfg.parallel.mode, cfg.parallel.sequence_parallel = layout.mode, layout.sequence_parallel
    cfg.model.bias_activation_fusion = layout.bias_activation_fusion


def build_mode_run(job: dict, name: str) -> dict:
    """One benchmark mode's built run (``train.build.build_run``: DDP model, optimizer, schedule
    runner), its synthetic micro-batches, and empty measurements."""
    from megatron_boost.config.resolved import resolve_run
    from megatron_boost.data.synthetic import synthetic_microbatches
    from megatron_boost.train.build import build_run

    seq, mb = job["seq_length"], job["micro_batch_size"]
    cfg = copy.deepcopy(job["cfg"])
    apply_bench_layout(cfg, name)
    cfg.parallel.tp, cfg.parallel.pp = job["tp"], job["pp"]
    cfg.training.recompute = job["recompute"]
    cfg.training.precision, cfg.training.seed = job["dtype"], job["seed"]
    cfg.model.seq_length, cfg.training.micro_batch_size = seq, mb
    cfg.training.global_batch_size = job["global_batch_size"]
    cfg.optimizer.warmup_iters = 0  # the scheduler is never stepped: every step at lr
    built = build_run(resolve_run(cfg, vocab_size=cfg.model.vocab_size))
    micro = synthetic_microbatches(cfg.model.vocab_size, seq, mb, job["global_batch_size"],
                                   job["seed"] + 1)
    return {"cfg": cfg, "built": built, "ddp": built.chunks, "opt": built.optimizer,
            "micro": micro, "vocab": built.run.padded_vocab_size,
            "fused_swiglu": bool(built.config.bias_activation_fusion), "times": [], "losses": [],
            "load": [], "own_cpu": [], "sys_busy": []}


def _timed_steps(runs: dict, job: dict, step) -> None:
    """Warm-up + timed steps, the modes interleaved, each between two barriers."""
    import torch.distributed as dist

    for i in range(job["warmup"] + job["steps"]):
        for r in runs.values():
            dist.barrier()
            t0, c0, b0 = time.perf_counter(), _own_cpu_s(), _system_busy_s()
            out = step(r)
            dist.barrier()
            t1, c1, b1 = time.perf_counter(), _own_cpu_s(), _system_busy_s()
            if i >= job["warmup"]:
                r["times"].append(t1 - t0)
                r["load"].append(os.getloadavg()[0])
                r["own_cpu"].append(c1 - c0)
                r["sys_busy"].append(b1 - b0)
            if out["loss"] is not None:
                r["losses"].append(out["loss"])


def _untimed_measurements(r: dict, job: dict, step) -> dict:
    """TP collectives of one more step and saved activations of one micro-batch forward."""
    from megatron.core import parallel_state

    from megatron_boost.measure.collectives import record_collectives
    from megatron_boost.measure.memory import SavedActivations

    with record_collectives(parallel_state.get_tensor_model_parallel_group()) as log:
        step(r)
    # Saved activations of one micro-batch forward (grad enabled, graph then dropped).
    params = [p for m in r["ddp"] for p in m.parameters()]
    its = [iter(r["micro"][:1]) for _ in r["ddp"]]
    with SavedActivations(exclude=params) as acc:
        r["built"].run_schedule(its, 1, forward_only=True)
    return {
        "times": r["times"], "losses": r["losses"], "load": r["load"],
        "own_cpu": r["own_cpu"], "sys_busy": r["sys_busy"],
        "comm": {"fwd_bytes": log.bytes("fwd"), "bwd_bytes": log.bytes("bwd"),
                 "fwd_count": log.count("fwd"), "bwd_count": log.count("bwd")},
        "saved_bytes": acc.bytes, "saved_tensors": acc.count,
        "params_local": sum(p.numel() for p in params),
        "vocab": r["vocab"], "fused_swiglu": r["fused_swiglu"],
    }


def bench_worker(rank: int, world: int, job: dict) -> dict:
    """Build every mode's model, run interleaved warm-up + timed steps, then measure comm,
    saved activations. Returns per-mode raw numbers of this rank."""
    import torch

    from megatron_boost.train.step import initialize_parallel, train_step

    torch.set_num_threads(job["threads"])
    initialize_parallel(job["tp"], job["pp"], None, job["seed"])
    seq, mb = job["seq_length"], job["micro_batch_size"]
    n_micro = job["global_batch_size"] // mb
    runs = {mode: build_mode_run(job, mode) for mode in job["modes"]}

    def step(r):
        its = [iter(r["micro"]) for _ in r["ddp"]]
        return train_step(r["built"].forward_step, its, r["ddp"], r["opt"], n_micro, seq, mb)

    _timed_steps(runs, job, step)
    results = {mode: _untimed_measurements(r, job, step)
               for mode, r in runs.items()}
    runs.clear()
    gc.collect()
    return results


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------


def _validate_mode(cfg, name, tp, pp, recompute):
    """None if the config accepts (benchmark mode name, tp, pp, recompute), else the reason."""
    from megatron_boost.config.resolved import check_model_rules

    c = copy.deepcopy(cfg)
    apply_bench_layout(c, name)
    c.parallel.tp, c.parallel.pp = tp, pp
    c.training.recompute = recompute
    try:
        c.validate()
        check_model_rules(c)
    except (ValueError, TypeError, AssertionError) as e:
        return str(e)
    return None


def _row(label, name, raw, cfg, tp, pp, seq, gbs, mb):
    """Aggregate one benchmark mode's per-rank results into the reported fields."""
    from megatron_boost.analysis.flops import rank_step_flops, step_flops
    from megatron_boost.config.modes import resolve_sequence_parallel

    layout = layout_of(name)
    mode, requested_sp = layout.mode, layout.sequence_parallel
    r0 = raw[0]
    times = r0["times"]
    med = statistics.median(times) if times else float("nan")
    tokens = gbs * seq
    flops = step_flops(cfg, mode, tokens, r0["vocab"], seq)
    rank_flops = rank_step_flops(cfg, mode, tokens, r0["vocab"], seq, tp)
    comm = r0["comm"]
    # CPU used by OTHER processes during each timed step: machine-wide busy CPU seconds minus
    # those of this run's processes, as a fraction of the machine's capacity (wall · CPUs).
    ncpu = os.cpu_count() or 1
    foreign = []
    for i, wall in enumerate(times):
        own = sum(r["own_cpu"][i] for r in raw)
        foreign.append(max(0.0, r0["sys_busy"][i] - own) / (wall * ncpu))
    losses = r0["losses"] or next((r["losses"] for r in raw if r["losses"]), [])
    return {
        "label": label, "mode": mode, "tp": tp, "pp": pp,
        "sequence_parallel": resolve_sequence_parallel(mode, tp, requested_sp)[0],
        "fused_swiglu": r0["fused_swiglu"],  # megatron's config as built
        "step_time_median_s": med, "step_times_s": times,
        "step_time_min_s": min(times) if times else None,
        "tokens_per_step": tokens, "tokens_per_s": tokens / med if times else None,
        "tp_comm_bytes_per_step": comm["fwd_bytes"] + comm["bwd_bytes"],
        "tp_comm_fwd_bytes_per_step": comm["fwd_bytes"],
        "tp_comm_bwd_bytes_per_step": comm["bwd_bytes"],
        "tp_comm_collectives_per_step": comm["fwd_count"] + comm["bwd_count"],
        "saved_activation_bytes_per_microbatch": max(r["saved_bytes"] for r in raw),
        "saved_activation_bytes_per_rank": [r["saved_bytes"] for r in raw],
        "saved_tensors_per_microbatch": max(r["saved_tensors"] for r in raw),
        "params_per_rank": [r["params_local"] for r in raw],
        "flops_per_step": flops,
        "achieved_flops_per_s": flops / med if times else None,
        "rank_executed_flops_per_step": rank_flops,
        "micro_batches_per_step": gbs // mb,
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "load_avg_1min": [round(x, 2) for x in r0["load"]],
        "other_processes_cpu_fraction": [round(x, 3) for x in foreign],
        "other_processes_cpu_fraction_median": (statistics.median(foreign) if foreign
                                                else None),
        "own_cpu_s_per_step_per_rank": [statistics.median(r["own_cpu"]) if r["own_cpu"]
                                        else None for r in raw],
    }


def _print_table(rows, out=sys.stdout):
    hdr = (f"{'run':28} {'step s (med)':>12} {'tokens/s':>9} {'TP comm MiB/step':>17} "
           f"{'saved act MiB/mb':>16} {'GFLOP/step':>11} {'GFLOP/s':>8} {'loss':>7} "
           f"{'other CPU':>9}")
    out.write(hdr + "\n" + "-" * len(hdr) + "\n")
    for r in rows:
        if r.get("unavailable"):
            out.write(f"{r['label']:28} unavailable: {r['unavailable']}\n")
            continue
        out.write(f"{r['label']:28} {r['step_time_median_s']:>12.3f} "
                  f"{r['tokens_per_s']:>9.0f} {r['tp_comm_bytes_per_step'] / 2**20:>17.2f} "
                  f"{r['saved_activation_bytes_per_microbatch'] / 2**20:>16.2f} "
                  f"{r['flops_per_step'] / 1e9:>11.2f} {r['achieved_flops_per_s'] / 1e9:>8.2f} "
                  f"{(r['loss_last'] if r['loss_last'] is not None else float('nan')):>7.3f} "
                  f"{r['other_processes_cpu_fraction_median']:>9.0%}\n")


def _png(rows, ratios, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r.get("unavailable")]
    labels = [r["label"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    colors = {TPMode.FULL: "tab:gray", FULL_SP: "black", FULL_SWIGLU: "dimgray",
              TPMode.NAIVE: "tab:red", TPMode.BOOST: "tab:green"}
    c = [colors.get(r["label"].split()[0], "tab:blue") if "single" not in r["label"] else
         "tab:blue" for r in rows]
    for ax, key, scale, title in (
            (axes[0], "step_time_median_s", 1.0, "median step time (s)"),
            (axes[1], "tp_comm_bytes_per_step", 2 ** -20, "TP comm per step (MiB)"),
            (axes[2], "saved_activation_bytes_per_microbatch", 2 ** -20,
             "saved activations per micro-batch (MiB/rank)")):
        vals = [r[key] * scale for r in rows]
        bars = ax.bar(range(len(rows)), vals, color=c)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        for b, v in zip(bars, vals):
            ax.annotate(f"{v:.3g}", (b.get_x() + b.get_width() / 2, v), ha="center",
                        va="bottom", fontsize=8)
    sub = ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items() if v is not None)
    fig.suptitle(f"megatron-boost CPU benchmark ({sub})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-boost-benchmark", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument("--tp", type=positive_int, required=True)
    parser.add_argument("--pp", type=positive_int, default=1)
    parser.add_argument("--modes", type=bench_mode_list, default="full,full+sp,naive,boost",
                        help="comma-separated: full (no sequence parallelism, the BOOST "
                             "paper's baseline), full+sp (megatron's), full+swiglu (the "
                             "paper's with megatron's fused SwiGLU), naive, boost")
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps per mode")
    parser.add_argument("--warmup", type=non_negative_int, default=1, help="untimed steps per mode")
    parser.add_argument("--single", action="store_true",
                        help="add boost at TP=1 in one process with 2 threads")
    parser.add_argument("--single-threads", type=positive_int, default=2)
    parser.add_argument("--recompute", choices=["none", "selective", "full", "lowrank"],
                        default="none")
    parser.add_argument("--micro-batch-size", type=positive_int, default=None)
    parser.add_argument("--global-batch-size", type=positive_int, default=None)
    parser.add_argument("--seq-length", type=positive_int, default=None)
    parser.add_argument("--seed", type=non_negative_int, default=1234)
    parser.add_argument("--json", type=output_file, default=None,
                        help="write the figures here (checked before measuring)")
    parser.add_argument("--png", type=output_file, default=None,
                        help="plot the step times here (checked before measuring)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_layers=2")
    return parser


def _unavailable(cfg, modes, tp, pp, recompute) -> dict:
    """Per mode the config rejects at this layout, the reason (printed to stderr)."""
    unavailable = {}
    for mode in modes:
        why = _validate_mode(cfg, mode, tp, pp, recompute)
        if why:
            unavailable[mode] = why
            what = "recompute=lowrank is unavailable" if recompute == "lowrank" else \
                "not runnable"
            print(f"{mode}: {what}: {why}", file=sys.stderr)
    return unavailable


def _run_rows(args, cfg, job: dict, modes, unavailable: dict, single_why) -> list:
    """Run the runnable modes (and the single-process row) and aggregate one row each."""
    from megatron_boost.runtime.spawn import run_distributed

    seq, mb, gbs = job["seq_length"], job["micro_batch_size"], job["global_batch_size"]
    rows, raw_by_mode = [], {}
    if job["modes"]:
        per_rank = run_distributed(bench_worker, args.tp * args.pp, job, timeout=3600)
        raw_by_mode = {m: [r[m] for r in per_rank] for m in job["modes"]}
    for mode in modes:
        label = f"{mode} TP={args.tp}" + (f" PP={args.pp}" if args.pp > 1 else "")
        if mode in unavailable:
            rows.append({"label": label, "mode": mode_of(mode),
                         "unavailable": unavailable[mode]})
        else:
            rows.append(_row(label, mode, raw_by_mode[mode], cfg, args.tp, args.pp, seq, gbs,
                             mb))
    if args.single:
        label = f"{TPMode.BOOST} TP=1 single ({args.single_threads} thr)"
        if single_why:
            rows.append({"label": label, "mode": TPMode.BOOST, "unavailable": single_why})
        else:
            sjob = dict(job, tp=1, pp=1, threads=args.single_threads, modes=[TPMode.BOOST])
            raw = run_distributed(bench_worker, 1, sjob, timeout=3600)
            rows.append(_row(label, TPMode.BOOST, [raw[0][TPMode.BOOST]], cfg, 1, 1, seq, gbs,
                             mb))
            rows[-1]["single"] = True
    return rows


def _ratios(rows) -> dict:
    by = {r["label"].split()[0] if not r.get("single") else "single": r
          for r in rows if not r.get("unavailable")}

    def ratio(a, b):
        if a in by and b in by:
            return by[a]["step_time_median_s"] / by[b]["step_time_median_s"]
        return None

    # The strongest full-rank layout: the fastest of full (the paper's), full+sp (megatron's)
    # and full+swiglu (the paper's with megatron's fused SwiGLU).
    fulls = [f for f in (label_of(TPMode.FULL), FULL_SP, FULL_SWIGLU) if f in by]
    strongest = min(fulls, key=lambda f: by[f]["step_time_median_s"]) if fulls else None
    boost = TPMode.BOOST
    return {"boost/naive speed": ratio(TPMode.NAIVE, boost),
            "boost/full speed": ratio(TPMode.FULL, boost),
            "boost/full+sp speed": ratio(FULL_SP, boost),
            "boost/full+swiglu speed": ratio(FULL_SWIGLU, boost),
            "boost/strongest full speed": ratio(strongest, boost),
            "boost TP time / single time": ratio(boost, "single")}


def _targets(ratios: dict, tp: int) -> dict:
    """The TP=2 targets (printed, never enforced)."""
    targets = {}
    if tp != 2:
        return targets
    for name, key, thr, better in (
            ("boost >= 1.9x faster than naive", "boost/naive speed", 1.9, "ge"),
            ("boost >= 1.7x faster than full", "boost/full speed", 1.7, "ge"),
            ("boost TP=2 within 10% of single", "boost TP time / single time", 1.10, "le")):
        v = ratios[key]
        if v is None:
            continue
        met = v >= thr if better == "ge" else v <= thr
        targets[name] = {"value": v, "threshold": thr, "met": met}
        print(f"target {name}: {v:.2f} -> {'met' if met else 'NOT met'}")
    return targets


def _print_summary(rows, ratios: dict, load1) -> None:
    _print_table(rows)
    print("step s: median over the timed steps (barrier to barrier, all ranks); TP comm: bytes "
          "handed to TP collectives in one step (fwd + bwd, rank 0); saved act: bytes autograd "
          "saves in one micro-batch forward (max over ranks, parameters excluded); GFLOP/step: "
          "model matmul FLOPs (3x forward); GFLOP/s: that over the step time, whole TP group; "
          "other CPU: median share of the machine's CPU used by other processes during the "
          "timed steps")
    print(f"load average after: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    for k, v in ratios.items():
        if v is not None:
            print(f"{k}: {v:.2f}x")


def _report(args, cfg, job: dict, rows, ratios, targets, load0, load1) -> dict:
    m = cfg.model
    return {
        "config": args.config, "overrides": args.overrides, "tp": args.tp, "pp": args.pp,
        "seq_length": job["seq_length"], "micro_batch_size": job["micro_batch_size"],
        "global_batch_size": job["global_batch_size"], "dtype": job["dtype"],
        "recompute": args.recompute, "steps": args.steps, "warmup": args.warmup,
        "model": {"hidden_size": m.hidden_size, "ffn_hidden_size": m.ffn_hidden_size,
                  "num_layers": m.num_layers, "num_attention_heads": m.num_attention_heads,
                  "ranks": list(m.resolved_ranks()), "vocab_size": m.vocab_size},
        "load_avg_before": list(load0), "load_avg_after": list(load1),
        "cpu_count": os.cpu_count(),
        "modes": {r["label"]: r for r in rows}, "ratios": ratios, "targets": targets,
    }


@one_line_errors
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_boost.config.run import load_run_config

    cfg = load_run_config(args.config, args.overrides)
    seq = args.seq_length or cfg.model.seq_length
    cfg.model.seq_length = seq
    mb = args.micro_batch_size or cfg.training.micro_batch_size
    gbs = args.global_batch_size or cfg.training.global_batch_size
    if gbs % mb:
        raise ValueError(f"global batch ({gbs}) must be a multiple of micro-batch ({mb})")
    dtype = "bf16" if cfg.training.precision == "bf16" else "fp32"
    recompute = None if args.recompute == "none" else args.recompute
    modes = args.modes
    unavailable = _unavailable(cfg, modes, args.tp, args.pp, recompute)
    single_why = None
    if args.single:
        single_why = _validate_mode(cfg, TPMode.BOOST, 1, 1, recompute)
        if single_why:
            print(f"single: not runnable: {single_why}", file=sys.stderr)
    load0 = os.getloadavg()
    print(f"config {args.config}: d={cfg.model.hidden_size} f={cfg.model.ffn_hidden_size} "
          f"L={cfg.model.num_layers} h={cfg.model.num_attention_heads} "
          f"r={cfg.model.resolved_ranks()} V={cfg.model.vocab_size}  S={seq} mb={mb} "
          f"gbs={gbs} ({gbs // mb} micro-batches/step) {dtype} TP={args.tp} PP={args.pp} "
          f"recompute={args.recompute}  steps={args.steps} warmup={args.warmup}")
    print(f"load average before: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f} "
          f"({os.cpu_count()} CPUs)")
    job = {"cfg": cfg, "tp": args.tp, "pp": args.pp, "seq_length": seq,
           "micro_batch_size": mb, "global_batch_size": gbs, "dtype": dtype,
           "recompute": recompute, "steps": args.steps, "warmup": args.warmup,
           "seed": args.seed, "threads": 1,
           "modes": [m for m in modes if m not in unavailable]}
    rows = _run_rows(args, cfg, job, modes, unavailable, single_why)
    load1 = os.getloadavg()
    ratios = _ratios(rows)
    _print_summary(rows, ratios, load1)
    targets = _targets(ratios, args.tp)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(_report(args, cfg, job, rows, ratios, targets, load0, load1), fh,
                      indent=2)
    if args.png:
        _png(rows, ratios, args.png)
    return 0
