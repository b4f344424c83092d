"""Print how long building and initialising a model takes, the way the trainer does it.

Runs ``train.build.build_run`` (model chunks, weight initialisation, DDP wrap, optimizer) in a world
of one on the CPU for a run config (default ``configs/cola-1b.yaml`` at TP = 1) and prints the
wall time and this process's CPU time of that call, best of ``--repeats`` (on a shared machine
the CPU time is the steadier figure). A figure to compare before and after a change to
the initialisation path, never an assertion.

    python tools/init_time.py [--config configs/cola-1b.yaml] [--repeats 1] [--threads 1]
"""

from __future__ import annotations

import argparse
import gc
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/cola-1b.yaml")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("overrides", nargs="*", help="dotted config overrides")
    args = parser.parse_args(argv)

    import torch

    from megatron_boost.config.resolved import resolve_run
    from megatron_boost.config.run import load_run_config
    from megatron_boost.runtime.cpu_mode import use_cpu
    from megatron_boost.train import step
    from megatron_boost.train.build import build_run
    from megatron_boost.train.distributed import init_world_of_one, shutdown

    torch.set_num_threads(args.threads)
    use_cpu(force=True)
    init_world_of_one()
    try:
        cfg = load_run_config(args.config, ["parallel.tp=1", "parallel.pp=1", *args.overrides])
        step.initialize_parallel(1, 1, None, cfg.training.seed)
        precision = "bf16" if cfg.training.precision == "bf16" else "fp32"
        run = resolve_run(cfg, "cpu", vocab_size=cfg.model.vocab_size).with_precision(precision)
        times, cpu = [], []
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            built = build_run(run)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            n = sum(p.numel() for m in built.chunks for p in m.module.parameters())
            del built
            gc.collect()
        print(f"{args.config} mode={cfg.parallel.mode} params={n / 1e6:.1f}M "
              f"dtype={run.params_dtype} threads={args.threads}: build_run wall "
              f"{min(times):.2f}s, CPU {min(cpu):.2f}s (best of {len(times)}; wall "
              f"{', '.join(f'{t:.2f}' for t in times)}; CPU {', '.join(f'{t:.2f}' for t in cpu)})")
    finally:
        shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
