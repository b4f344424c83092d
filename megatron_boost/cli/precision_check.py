"""bf16 against fp32 with the same weights, per TP mode (``megatron_boost/analysis/precision.py``).

    python tools/precision_check.py --config configs/debug.yaml --tp 2
    python tools/precision_check.py --config configs/bench-cpu.yaml --tp 2 model.num_layers=2

Spawns ``--tp`` gloo processes on the CPU and prints, per mode, the relative L2 error of bf16's
per-token losses and of its gradient at the embedding output; exit status 1 when boost's loss
error exceeds naive's (boost keeps its norm statistic in fp32 and rounds only r-wide sums).
"""

from __future__ import annotations

import argparse

from megatron_boost.cli.arg_types import positive_int

__all__ = ["main"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="precision_check", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/debug.yaml", help="YAML run configuration")
    parser.add_argument("--tp", type=positive_int, default=2,
                        help="tensor-parallel size (processes)")
    parser.add_argument("--modes", default="full,naive,boost", help="comma-separated modes")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_boost.analysis.precision import bf16_error_worker
    from megatron_boost.runtime.spawn import run_distributed

    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    rows = run_distributed(bf16_error_worker, args.tp, args.config, list(args.overrides),
                           modes)[0]
    print(f"bf16 vs fp32 (same weights), {args.config}, TP={args.tp}")
    print(f"{'mode':<6} {'loss rel err':>14} {'grad rel err':>14}")
    for r in rows:
        print(f"{r['mode']:<6} {r['loss_rel_err']:>14.3e} {r['grad_rel_err']:>14.3e}")
    by_mode = {r["mode"]: r for r in rows}
    if "boost" in by_mode and "naive" in by_mode:
        ok = by_mode["boost"]["loss_rel_err"] <= by_mode["naive"]["loss_rel_err"]
        print(f"boost loss error <= naive's: {'yes' if ok else 'NO'}")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
