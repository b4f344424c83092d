#!/usr/bin/env python3
"""AdamW against Muon on the demo corpus: each at its best of several learning rates.

For each mode (boost: the demo's CoLA model; full: the same shape at full rank) and optimizer,
one training run per learning rate (``pretrain_lowrank.py`` under torchrun, the demo's config,
min_lr = lr / 10); the validation perplexity of each evaluation is read from the run's
metrics.jsonl. Then, per mode and optimizer, a timing run of the same model (synthetic
batches): the mean step time and the optimizer step's share of it. Writes a JSON file of every
figure and a text table (the one docs/performance.md includes).

    scripts/demo_data.sh                      # the demo corpus, once
    python scripts/compare_optimizers.py [--iters N] [--modes boost,full] \\
        [--adamw-lrs 1e-3,3e-3,1e-2] [--muon-lrs 1e-3,3e-3,1e-2,3e-2] \\
        [--full-adamw-lrs 3e-4,1e-3,3e-3] [--full-muon-lrs 3e-3,1e-2,3e-2] \\
        [--out docs/results/optimizers]

The default grids are those of the published result: around each optimizer's best in each mode,
with its best inside the grid (AdamW's best at full rank lies lower than in boost, Muon's best
in boost lower than at full rank).

The step times are best measured side by side on a quiet machine: ``--timing-only --append``
re-times every (mode, optimizer) of --modes in one sitting, one after the other, keeping the
runs (the training runs' perplexities do not depend on the machine's load).

A run that fails is recorded with its exit status and left out of the best-of. With --append,
OUT.json's runs, timings and command lines are kept: a run of the same mode, optimizer, learning
rate and iterations replaces the old one, and a (mode, optimizer) already timed is not timed
again. OUT.json and OUT.txt are rewritten after every run, so an interrupted sitting keeps the
runs it finished.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "demo-shakespeare.yaml"
#: Full rank at the demo's shape: the bottleneck ranks do not apply.
MODE_OVERRIDES = {"boost": ["parallel.mode=boost"],
                  "full": ["parallel.mode=full", "model.attn_rank=null", "model.mlp_rank=null"]}


def _floats(text: str):
    return [float(x) for x in text.split(",") if x]


def train(mode: str, optimizer: str, lr: float, iters: int, runs: Path, timeout: float) -> dict:
    """One training run; its validation perplexities by iteration (or its failure)."""
    run_dir = runs / f"{mode}-{optimizer}-lr{lr:g}"
    overrides = MODE_OVERRIDES[mode] + [
        f"optimizer.name={optimizer}", f"optimizer.lr={lr}", f"optimizer.min_lr={lr / 10}",
        f"training.train_iters={iters}", f"training.eval_interval={max(iters // 3, 1)}",
        f"optimizer.warmup_iters={iters // 10}",  # the demo's 30 of 300
        f"logging.run_dir={run_dir}", "logging.tensorboard=false", "logging.log_interval=20"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "pretrain_lowrank.py"), "--config", str(CONFIG), *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    out = {"mode": mode, "optimizer": optimizer, "lr": lr, "iters": iters,
           "seconds": round(time.time() - start, 1), "exit": proc.returncode}
    if proc.returncode != 0:
        out["error"] = [line for line in (proc.stderr + proc.stdout).splitlines()
                        if line.startswith("error:")][:1]
        return out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    out["val_ppl"] = {r["iteration"]: r["val_ppl"] for r in records if "val_ppl" in r}
    out["tokens"] = max(r["tokens"] for r in records)
    return out


def _time_steps(rank, world, mode, optimizer, steps):
    """Mean step time and optimizer-step time (seconds) of the demo model on this layout,
    with synthetic batches (the timing does not depend on the data)."""
    import torch

    from megatron_boost.config.resolved import resolve_run
    from megatron_boost.config.run import load_run_config
    from megatron_boost.data.synthetic import synthetic_microbatches
    from megatron_boost.train.build import build_run
    from megatron_boost.train.step import initialize_parallel, train_step

    cfg = load_run_config(str(CONFIG), MODE_OVERRIDES[mode] + [f"optimizer.name={optimizer}"])
    t = cfg.training
    initialize_parallel(cfg.parallel.tp, cfg.parallel.pp, None, t.seed)
    built = build_run(resolve_run(cfg, vocab_size=cfg.model.vocab_size))
    micro = synthetic_microbatches(cfg.model.vocab_size, cfg.model.seq_length,
                                   t.micro_batch_size, t.global_batch_size, t.seed, 1, 0)
    step_of_optimizer = built.optimizer.step
    optimizer_seconds = []

    def timed_step():
        begin = time.perf_counter()
        result = step_of_optimizer()
        optimizer_seconds.append(time.perf_counter() - begin)
        return result

    built.optimizer.step = timed_step
    step_seconds = []
    for i in range(steps + 2):  # two warm-up steps
        begin = time.perf_counter()
        train_step(built.forward_step, [iter(list(micro))], built.chunks, built.optimizer,
                   len(micro), cfg.model.seq_length, t.micro_batch_size)
        step_seconds.append(time.perf_counter() - begin)
    torch.distributed.barrier()
    return {"step_s": sum(step_seconds[2:]) / steps,
            "optimizer_s": sum(optimizer_seconds[2:]) / steps}


def time_steps(mode: str, optimizer: str, steps: int) -> dict:
    from megatron_boost.runtime.spawn import run_distributed

    return run_distributed(_time_steps, 2, mode, optimizer, steps, timeout=900)[0]


def best(runs, mode, optimizer):
    """The run of (mode, optimizer) with the lowest final validation perplexity."""
    done = [r for r in runs if r["mode"] == mode and r["optimizer"] == optimizer
            and r.get("val_ppl")]
    return min(done, key=final_ppl, default=None)


def final_ppl(run) -> float:
    """The last evaluation's perplexity (iterations are strings once read back from JSON)."""
    return run["val_ppl"][max(run["val_ppl"], key=int)]


def table(results: dict) -> str:
    runs, timing = results["runs"], results["timing"]
    iters = max(r["iters"] for r in runs)
    tokens = max((r.get("tokens", 0) for r in runs), default=0)
    mode_order = {m: i for i, m in enumerate(results["modes"])}
    runs = sorted(runs, key=lambda r: (mode_order.get(r["mode"], len(mode_order)),
                                       r["optimizer"], r["lr"]))
    lines = [*(f"$ {c}" for c in results["commands"]),
             f"AdamW vs Muon on the demo corpus ({CONFIG.relative_to(ROOT)}: d=256, 4 layers, "
             f"TP=2, CPU), {iters} iterations ({tokens:,} tokens) per run; "
             f"validation perplexity on the held-out plays",
             "", f"{'mode':<6} {'optimizer':<9} {'lr':>8}   validation ppl by iteration"]
    for r in runs:
        ppl = ("failed (exit %s)" % r["exit"] if not r.get("val_ppl") else
               "  ".join(f"@{it}: {p:8.2f}" for it, p in sorted(r["val_ppl"].items(),
                                                                key=lambda kv: int(kv[0]))))
        lines.append(f"{r['mode']:<6} {r['optimizer']:<9} {r['lr']:>8g}   {ppl}")
    lines += ["", "best run of each (lowest final validation ppl among its learning rates), and "
              "the step time on this machine (mean of the timed steps; optimizer step's share):",
              f"{'mode':<6} {'optimizer':<9} {'best lr':>8} {'final ppl':>10} "
              f"{'step ms':>9} {'optimizer ms':>13} {'share':>6}"]
    for mode in results["modes"]:
        for optimizer in ("adamw", "muon"):
            b = best(runs, mode, optimizer)
            tm = timing.get(f"{mode}-{optimizer}")
            lr = f"{b['lr']:g}" if b else "-"
            final = f"{final_ppl(b):.2f}" if b else "-"
            step = f"{tm['step_s'] * 1e3:.0f}" if tm else "-"
            opt = f"{tm['optimizer_s'] * 1e3:.0f}" if tm else "-"
            share = f"{tm['optimizer_s'] / tm['step_s']:.0%}" if tm else "-"
            lines.append(f"{mode:<6} {optimizer:<9} {lr:>8} {final:>10} {step:>9} {opt:>13} "
                         f"{share:>6}")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=300, help="iterations per run (demo: 300)")
    p.add_argument("--modes", default="boost,full")
    p.add_argument("--adamw-lrs", default="1e-3,3e-3,1e-2")
    p.add_argument("--muon-lrs", default="1e-3,3e-3,1e-2,3e-2")
    p.add_argument("--full-adamw-lrs", default="3e-4,1e-3,3e-3",
                   help="AdamW's learning rates at full rank")
    p.add_argument("--full-muon-lrs", default="3e-3,1e-2,3e-2",
                   help="Muon's learning rates at full rank")
    p.add_argument("--timing-steps", type=int, default=5)
    p.add_argument("--runs", default="runs/optimizers", help="where the runs are written")
    p.add_argument("--out", default="docs/results/optimizers",
                   help="writes OUT.json and OUT.txt")
    p.add_argument("--timeout", type=float, default=3600)
    p.add_argument("--timing-only", action="store_true",
                   help="no training runs: re-time each (mode, optimizer) side by side")
    p.add_argument("--append", action="store_true",
                   help="add to OUT.json (more runs measured in another sitting; see above)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.timing_only and not (ROOT / "data/shakespeare/tokenizer.model").is_file():
        print("error: the demo corpus is missing (data/shakespeare); run scripts/demo_data.sh "
              "first", file=sys.stderr)
        return 2
    modes, out = args.modes.split(","), Path(args.out)
    results = start_results(out, args.append, modes,
                            argv if argv is not None else sys.argv[1:])
    if args.timing_only:
        retime(results, modes, args.timing_steps, out)
    else:
        for mode in modes:
            for optimizer in ("adamw", "muon"):
                run_grid(results, args, mode, optimizer, out)
        write(results, out)
    print(table(results))
    return 0


def start_results(out: Path, append: bool, modes, argv) -> dict:
    """This sitting's results: empty, or OUT.json's with ``append``; with ``modes`` and this
    command line added."""
    results = {"modes": [], "runs": [], "timing": {}, "commands": []}
    if append and out.with_suffix(".json").is_file():
        results = json.loads(out.with_suffix(".json").read_text())
        results.setdefault("commands", [])
    results["modes"] += [m for m in modes if m not in results["modes"]]
    results["commands"].append(shlex.join(["python", "scripts/compare_optimizers.py", *argv]))
    return results


def run_grid(results: dict, args: argparse.Namespace, mode: str, optimizer: str,
             out: Path) -> None:
    """One training run per learning rate of (mode, optimizer)'s grid, then its timing (unless
    already timed); OUT is rewritten after each."""
    lrs = _floats(getattr(args, f"full_{optimizer}_lrs" if mode == "full"
                          else f"{optimizer}_lrs"))
    for lr in lrs:
        record(results, train(mode, optimizer, lr, args.iters, Path(args.runs), args.timeout))
        print(json.dumps(results["runs"][-1]), flush=True)
        write(results, out)
    key = f"{mode}-{optimizer}"
    if lrs and key not in results["timing"]:
        results["timing"][key] = time_steps(mode, optimizer, args.timing_steps)
        print(mode, optimizer, results["timing"][key], flush=True)
        write(results, out)


def retime(results: dict, modes, steps: int, out: Path) -> None:
    """Time every (mode, optimizer) of ``modes`` in this sitting, replacing earlier timings."""
    for mode in modes:
        for optimizer in ("adamw", "muon"):
            key = f"{mode}-{optimizer}"
            results["timing"][key] = time_steps(mode, optimizer, steps)
            print(mode, optimizer, results["timing"][key], flush=True)
            write(results, out)


def record(results: dict, run: dict) -> None:
    """Add a run, replacing an earlier one of the same mode, optimizer, lr and iterations."""
    same = ("mode", "optimizer", "lr", "iters")
    results["runs"] = [r for r in results["runs"]
                       if any(r[k] != run[k] for k in same)] + [run]


def write(results: dict, out: Path) -> None:
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    if results["runs"]:
        out.with_suffix(".txt").write_text(table(results))


if __name__ == "__main__":
    sys.exit(main())
