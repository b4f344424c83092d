"""The BOOST paper's iteration-time table on the allocated GPUs: full, naive and boost back to back.

    scripts/slurm/paper_table.sh [--rows 1B,3B | all] [--warmup 2] [--iters 5] [--json FILE]
    scripts/slurm/paper_table.sh --dry-run          # CPU, tiny shapes, 2 processes

The driver (no torch import) launches one ``torchrun`` per world size a row needs (TP · PP
GPUs, as the authors' weak-scaling table: dp = 1, one micro-batch of 4 × 4096 tokens per
step), the ranks run ``--worker``: for each row and each mode in turn, the model of the row's
config (``perf.published.PAPER_ROWS``) is built (``cli.benchmark.build_mode_run``: the one
builder, synthetic tokens), ``--warmup`` steps, then ``--iters`` steps timed between two
barriers, the peak memory of that mode, and the model is freed before the next mode. The
driver then prints one table: iteration time (median), tokens/s, MFU, peak memory per mode,
boost/full and boost/naive speed-ups, the published A100 seconds beside them
(``perf.published``) and the performance model's prediction for the detected GPU
(``perf.model``), and writes it all as JSON (``scripts/render_docs.py``'s ``paper-table``
block renders it as a docs page).

``--dry-run`` is the same code path on the CPU: every row at tiny widths (the row's layout
shrunk to two processes), gloo, fp32; its figures are labelled CPU and mean nothing for the
paper. Rows that need more GPUs than this node has are reported as skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional

from megatron_boost.cli.arg_types import non_negative_int, output_file, positive_int
from megatron_boost.cli.errors import one_line_errors
from megatron_boost.config.modes import TPMode

MODES = tuple(TPMode)
DRY_RUN_WORLD = 2
#: The dry run's widths: every row's depth pattern kept small (the shapes divide TP 2).
DRY_RUN_MODEL = ["model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
                 "model.num_attention_heads=4", "model.attn_rank=16", "model.mlp_rank=16",
                 "model.seq_length=64", "model.vocab_size=256", "data.mock_vocab_size=256",
                 "training.device=cpu", "training.precision=fp32"]


# ---------------------------------------------------------------------------------------------
# worker (every rank of one torchrun)
# ---------------------------------------------------------------------------------------------


def _measure_mode(job: dict, cfg, mode: str, tp: int, pp: int, dp: int) -> dict:
    """Build ``mode``'s model, warm up, time ``iters`` steps; free it. This rank's figures."""
    import gc
    import time

    import torch
    import torch.distributed as dist

    from megatron_boost.cli.benchmark import build_mode_run
    from megatron_boost.train.metrics import peak_memory_bytes
    from megatron_boost.train.step import train_step

    device = job["device"]
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    mb, seq = cfg.training.micro_batch_size, cfg.model.seq_length
    run = build_mode_run(dict(cfg=cfg, tp=tp, pp=pp, recompute=None,
                              dtype=cfg.training.precision, seed=cfg.training.seed,
                              seq_length=seq, micro_batch_size=mb,
                              global_batch_size=mb * dp), mode)
    times = []
    for i in range(job["warmup"] + job["iters"]):
        its = [iter(run["micro"]) for _ in run["ddp"]]
        dist.barrier()
        t0 = time.perf_counter()
        train_step(run["built"].forward_step, its, run["ddp"], run["opt"], 1, seq, mb)
        if device == "cuda":
            torch.cuda.synchronize()
        dist.barrier()
        if i >= job["warmup"]:
            times.append(time.perf_counter() - t0)
    out = {"times": times, "peak_memory_bytes": peak_memory_bytes(device),
           "vocab": run["vocab"]}
    del run
    gc.collect()
    return out


def _row_config(job: dict, row: str):
    from megatron_boost.config.run import load_run_config
    from megatron_boost.perf.published import PAPER_ROWS

    config, tp, pp, _ = PAPER_ROWS[row]
    if job["dry_run"]:
        tp, pp = _dry_run_layout(tp, pp)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_run_config(config, [f"parallel.tp={tp}", f"parallel.pp={pp}",
                                   *job["overrides"]], world_size=world)
    return cfg, tp, pp, world // (tp * pp)


def _dry_run_layout(tp: int, pp: int) -> tuple:
    """The row's layout within two processes: a pipelined row keeps its pipeline (PP = 2),
    the others their TP (at most 2)."""
    return (1, DRY_RUN_WORLD) if pp > 1 else (min(tp, DRY_RUN_WORLD), 1)


def worker(job: dict) -> int:
    """Every rank: the rows of ``job`` whose layout this world runs; rank 0 writes JSON."""
    import datetime

    import torch.distributed as dist

    from megatron_boost.cli.pretrain import select_device
    from megatron_boost.train.distributed import init_distributed, shutdown
    from megatron_boost.train.step import initialize_parallel

    device = select_device("cpu" if job["dry_run"] else "cuda")
    job = dict(job, device=device)
    init_distributed(device, datetime.timedelta(minutes=30))
    results = {}
    try:
        for row in job["rows"]:
            cfg, tp, pp, dp = _row_config(job, row)
            initialize_parallel(tp, pp, None, cfg.training.seed)
            results[row] = {"tp": tp, "pp": pp, "dp": dp,
                            "seq_length": cfg.model.seq_length,
                            "micro_batch_size": cfg.training.micro_batch_size, "modes": {}}
            for mode in MODES:
                cfg.parallel.mode = mode
                mine = _measure_mode(job, cfg, mode, tp, pp, dp)
                every = [None] * dist.get_world_size()
                dist.all_gather_object(every, mine)
                results[row]["modes"][mode] = {
                    "times_s": every[0]["times"], "vocab": every[0]["vocab"],
                    "peak_memory_bytes": max(r["peak_memory_bytes"] for r in every)}
            from megatron.core import parallel_state
            parallel_state.destroy_model_parallel()
        if dist.get_rank() == 0:
            with open(job["out"], "w") as fh:
                json.dump({"device": _device_name(device), "rows": results}, fh)
    finally:
        shutdown()
    return 0


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------


def hardware_key(device_name: str) -> Optional[str]:
    """The perf model's GPU (``perf.hardware.HARDWARE`` key) for a CUDA device name."""
    name = device_name.lower()
    if "h200" in name:
        return "h200"
    if "h100" in name:
        return "h100-80gb"
    if "a100" in name:
        return "a100-40gb" if "40gb" in name else "a100-80gb"
    return None


def _launch(world: int, rows: List[str], args, out: str) -> None:
    """One torchrun of ``world`` ranks running ``rows``; raises ValueError if it fails."""
    job = dict(rows=rows, warmup=args.warmup, iters=args.iters, dry_run=args.dry_run,
               overrides=(DRY_RUN_MODEL if args.dry_run else []) + list(args.overrides),
               out=out)
    cmd = [*launcher_command(), "--standalone", f"--nproc-per-node={world}", "-m",
           "megatron_boost.cli.paper_table", "--worker", json.dumps(job)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if subprocess.run(cmd, env=env).returncode != 0:
        raise ValueError(f"the {world}-process run of rows {', '.join(rows)} failed (its "
                         f"output is above); fix that, or leave those rows out with --rows")


def launcher_command() -> List[str]:
    """``TORCHRUN`` (split at spaces) or this interpreter's torch.distributed.run; ValueError
    naming the variable when its command is not found."""
    value = os.environ.get("TORCHRUN", "")
    if not value.split():
        return [sys.executable, "-m", "torch.distributed.run"]
    if shutil.which(value.split()[0]) is None:
        raise ValueError(f"TORCHRUN='{value}': '{value.split()[0]}' is not a command found "
                         f"on PATH; set TORCHRUN to the torchrun launcher (e.g. torchrun or "
                         f"'python -m torch.distributed.run'), or unset it")
    return value.split()


def gpu_count() -> int:
    """The GPUs of this node: ``MBOOST_GPUS`` when set (a ValueError naming it unless it is a
    non-negative integer), else what nvidia-smi lists."""
    value = os.environ.get("MBOOST_GPUS")
    if not value:
        return _gpus_here()
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"MBOOST_GPUS='{value}' is not a GPU count; set it to this node's "
                         f"number of GPUs (e.g. MBOOST_GPUS=8) or unset it to count them with "
                         f"nvidia-smi")
    return count


def _gpus_here() -> int:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True) \
        if shutil.which("nvidia-smi") else None
    return len(out.stdout.strip().splitlines()) if out and out.returncode == 0 else 0


def run_table(args) -> dict:
    """Launch the rows, grouped by world size; the merged raw results."""
    from megatron_boost.perf.published import PAPER_ROWS

    gpus = DRY_RUN_WORLD if args.dry_run else gpu_count()
    by_world: Dict[int, List[str]] = {}
    skipped = {}
    for row in args.rows:
        _, tp, pp, _ = PAPER_ROWS[row]
        world = DRY_RUN_WORLD if args.dry_run else tp * pp
        if world > gpus:
            skipped[row] = f"needs {world} GPUs, this node has {gpus}"
            continue
        by_world.setdefault(world, []).append(row)
    if not by_world:
        raise ValueError(f"no row of --rows {','.join(args.rows)} fits this node's {gpus} "
                         f"GPU(s) ({'; '.join(f'{r} {why}' for r, why in skipped.items())}); "
                         f"run on a GPU node, set MBOOST_GPUS, or try --dry-run on the CPU")
    merged = {"device": "cpu" if args.dry_run else None, "rows": {}, "skipped": skipped}
    with tempfile.TemporaryDirectory() as tmp:
        for world, rows in sorted(by_world.items()):
            out = os.path.join(tmp, f"world{world}.json")
            _launch(world, rows, args, out)
            with open(out) as fh:
                part = json.load(fh)
            merged["device"] = part["device"]
            merged["rows"].update(part["rows"])
    return merged


def summarise(raw: dict, dry_run: bool, warmup: int, iters: int) -> dict:
    """The table's figures from the raw per-mode times (JSON-ready)."""
    from megatron_boost.analysis.flops import step_flops
    from megatron_boost.config.shape import ModelShape
    from megatron_boost.config.run import load_run_config
    from megatron_boost.perf.hardware import hardware
    from megatron_boost.perf.model import Layout, predict
    from megatron_boost.perf.published import PAPER_ROWS, PUBLISHED_A100
    from megatron_boost.runtime.devices import peak_dense_bf16_tflops

    device = raw["device"] or "unknown"
    gpu = None if dry_run else hardware_key(device)
    peak = None if dry_run else peak_dense_bf16_tflops(device)
    rows = []
    for row, r in raw["rows"].items():
        config, _, _, published_row = PAPER_ROWS[row]
        cfg = load_run_config(config, (DRY_RUN_MODEL if dry_run else [])
                              + [f"parallel.tp={r['tp']}", f"parallel.pp={r['pp']}"])
        mb, seq, world = r["micro_batch_size"], r["seq_length"], r["tp"] * r["pp"] * r["dp"]
        tokens = mb * seq * r["dp"]
        published = PUBLISHED_A100[published_row][2] if published_row else {}
        for mode in MODES:
            m = r["modes"][mode]
            med = statistics.median(m["times_s"])
            flops = step_flops(cfg, mode, tokens, m["vocab"], seq)
            predicted = None
            if gpu is not None:
                shape = ModelShape.from_config(cfg.model)  # the run's (3B: 28 layers)
                lay = Layout(mode=mode, tp=r["tp"], pp=r["pp"], dp=r["dp"], micro_batch=mb,
                             global_batch=mb * r["dp"], recompute="none")
                predicted = round(predict(shape, lay, hardware(gpu)).iteration_s, 4)
            rows.append({
                "row": row, "mode": mode, "tp": r["tp"], "pp": r["pp"], "dp": r["dp"],
                "iteration_s": round(med, 4), "iteration_times_s": m["times_s"],
                "tokens_per_s": round(tokens / med, 1),
                "mfu": None if peak is None else round(flops / med / (peak * 1e12 * world), 4),
                "peak_memory_gib": round(m["peak_memory_bytes"] / 2 ** 30, 2),
                "published_a100_s": published.get(mode), "predicted_s": predicted})
    return {"device": device, "cpu_dry_run": dry_run, "perf_model_gpu": gpu,
            "warmup": warmup, "iters": iters, "rows": rows, "skipped": raw["skipped"],
            "ratios": _ratios(rows)}


def _ratios(rows: List[dict]) -> Dict[str, dict]:
    """Per row: boost's speed-up over full and over naive, measured and published."""
    out = {}
    for row in dict.fromkeys(r["row"] for r in rows):
        t = {r["mode"]: r for r in rows if r["row"] == row}

        def speedup(key, base):
            a, b = t[TPMode.BOOST][key], t[base][key]
            return round(b / a, 3) if a and b else None
        out[row] = {"boost_vs_full": speedup("iteration_s", TPMode.FULL),
                    "boost_vs_naive": speedup("iteration_s", TPMode.NAIVE),
                    "published_boost_vs_full": speedup("published_a100_s", TPMode.FULL),
                    "published_boost_vs_naive": speedup("published_a100_s", TPMode.NAIVE)}
    return out


def _cell(value, fmt: str = "{}") -> str:
    return "—" if value is None else fmt.format(value)


def markdown_table(report: dict) -> str:
    """The table as Markdown (the console and ``scripts/render_docs.py``'s paper-table block)."""
    where = ("CPU dry run (gloo, tiny shapes): figures of this machine's CPU, not of the "
             "paper's models" if report["cpu_dry_run"] else f"measured on {report['device']}")
    memory = "peak RSS GiB (CPU)" if report["cpu_dry_run"] else "peak memory GiB"
    head = ["row", "mode", "tp×pp×dp", "iteration s", "tokens/s", "MFU", memory,
            "published A100 s", f"predicted s ({report['perf_model_gpu'] or 'no GPU'})"]
    lines = [f"Paper table: {where}; {report['warmup']} warm-up + {report['iters']} measured "
             f"iterations per mode, median.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in report["rows"]:
        lines.append("| " + " | ".join([
            r["row"], r["mode"], f"{r['tp']}×{r['pp']}×{r['dp']}", f"{r['iteration_s']:.3f}",
            f"{r['tokens_per_s']:,.0f}", _cell(r["mfu"], "{:.1%}"),
            f"{r['peak_memory_gib']:.2f}", _cell(r["published_a100_s"], "{:.2f}"),
            _cell(r["predicted_s"], "{:.2f}")]) + " |")
    lines += ["", "| row | boost/full | boost/vanilla | published boost/full | "
              "published boost/vanilla |", "|---|---|---|---|---|"]
    for row, q in report["ratios"].items():
        lines.append(f"| {row} | " + " | ".join(_cell(q[k], "{:.2f}×") for k in (
            "boost_vs_full", "boost_vs_naive", "published_boost_vs_full",
            "published_boost_vs_naive")) + " |")
    for row, why in report["skipped"].items():
        lines.append(f"\nskipped {row}: {why}")
    return "\n".join(lines) + "\n"


def _rows(text: str) -> List[str]:
    from megatron_boost.perf.published import PAPER_ROWS

    rows = list(PAPER_ROWS) if text == "all" else [r.strip() for r in text.split(",")]
    unknown = [r for r in rows if r not in PAPER_ROWS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown row(s) {', '.join(unknown)}; choose from {', '.join(PAPER_ROWS)} or all")
    return rows


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=_rows, default="all",
                   help="comma-separated rows of the table (1B, 1B-tp4, 3B, 7B, 13B) or all")
    p.add_argument("--warmup", type=non_negative_int, default=2, help="untimed steps per mode")
    p.add_argument("--iters", type=positive_int, default=5, help="timed steps per mode")
    p.add_argument("--json", type=output_file,
                   help="write the report (JSON) here (checked before anything runs)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny shapes, 2 processes: the code path without a GPU")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="section.key=value for every row's config")
    return p


@one_line_errors
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker(json.loads(args.worker))
    if isinstance(args.rows, str):
        args.rows = _rows(args.rows)
    launcher_command()  # the environment's settings, before anything runs
    if not args.dry_run:
        gpu_count()
    report = summarise(run_table(args), args.dry_run, args.warmup, args.iters)
    sys.stdout.write(markdown_table(report))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
            fh.write("\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
