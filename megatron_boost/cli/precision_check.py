"""bf16 against fp32 with the same weights, per TP mode (``megatron_boost/measure/precision.py``).

    python tools/precision_check.py --config configs/debug.yaml --tp 2
    python tools/precision_check.py --config configs/bench-cpu.yaml --tp 2 model.num_layers=2

Spawns ``--tp`` gloo processes on the CPU and prints, per mode, the relative L2 error of bf16's
per-token losses and of its gradient at the embedding output; exit status 1 when boost's loss
error exceeds naive's (boost keeps its norm statistic in fp32 and rounds only r-wide sums).
"""

from __future__ import annotations

import argparse
from typing import Dict, List, Sequence

from megatron_boost.cli.arg_types import mode_list, positive_int
from megatron_boost.cli.errors import one_line_errors
from megatron_boost.config.modes import TPMode

__all__ = ["main", "bf16_error_worker", "precision_models"]


def precision_models(run):
    """(fp32 model, bf16 model) of a resolved run at TP = world: one chunk each from the one
    builder, the same initial weights (the bf16 one wrapped in Float16Module)."""
    from megatron_boost.train.build import build_run

    (fp32,) = build_run(run.with_precision("fp32"), training=False).chunks
    (bf16,) = build_run(run.with_precision("bf16"), training=False).chunks
    return fp32.train(), bf16.train()


def bf16_error_worker(rank: int, world: int, config_path: str, overrides: Sequence[str],
                      modes: Sequence[str]) -> List[Dict[str, float]]:
    """In each of ``world`` = tp gloo processes: per mode, the relative bf16 errors of the
    losses and of the embedding-output gradient (rank 0's view; every TP rank holds the
    same losses). Both models come from the one builder, resolved for this process (the
    tokenizer's padded vocabulary, the rotary base, the seed)."""
    import torch

    from megatron_boost.measure.precision import losses_and_grad, relative_error, round_to_bf16_
    from megatron_boost.config.resolved import resolve_run
    from megatron_boost.config.run import load_run_config
    from megatron_boost.train.step import initialize_parallel

    base = load_run_config(config_path, [*overrides, f"parallel.tp={world}"])
    initialize_parallel(world, 1, None, base.training.seed)
    vocab = resolve_run(base).vocab_size
    gen = torch.Generator().manual_seed(base.training.seed)
    tokens = torch.randint(0, vocab, (base.training.micro_batch_size,
                                      base.model.seq_length + 1), generator=gen)
    rows = []
    for mode in modes:
        run = resolve_run(load_run_config(config_path, [*overrides, f"parallel.tp={world}",
                                                        f"parallel.mode={mode}"]))
        ref_model, bf16_model = precision_models(run)
        round_to_bf16_(ref_model)
        ref_loss, ref_grad = losses_and_grad(ref_model, tokens)
        loss, grad = losses_and_grad(bf16_model, tokens)
        rows.append({"mode": mode, "loss_rel_err": relative_error(loss, ref_loss),
                     "grad_rel_err": relative_error(grad, ref_grad)})
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="precision_check", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/debug.yaml", help="YAML run configuration")
    parser.add_argument("--tp", type=positive_int, default=2,
                        help="tensor-parallel size (processes)")
    parser.add_argument("--modes", type=mode_list, default="full,naive,boost",
                        help="comma-separated modes")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser.parse_args(argv)


@one_line_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_boost.runtime.spawn import run_distributed

    modes = args.modes
    rows = run_distributed(bf16_error_worker, args.tp, args.config, list(args.overrides),
                           modes)[0]
    print(f"bf16 vs fp32 (same weights), {args.config}, TP={args.tp}")
    print(f"{'mode':<6} {'loss rel err':>14} {'grad rel err':>14}")
    for r in rows:
        print(f"{r['mode']:<6} {r['loss_rel_err']:>14.3e} {r['grad_rel_err']:>14.3e}")
    by_mode = {r["mode"]: r for r in rows}
    if TPMode.BOOST in by_mode and TPMode.NAIVE in by_mode:
        ok = by_mode[TPMode.BOOST]["loss_rel_err"] <= by_mode[TPMode.NAIVE]["loss_rel_err"]
        print(f"boost loss error <= naive's: {'yes' if ok else 'NO'}")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
