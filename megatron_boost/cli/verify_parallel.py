"""Check that a parallel layout computes the same function as one process, on CPU
(docs/design.md §11).

    megatron-boost-verify-parallel --config configs/cola-7b.yaml --tp 2 --pp 2 --dp 1 --tiny
    megatron-boost-verify-parallel --config configs/cola-7b.yaml --tp 2 --tiny --mode naive

Spawns tp·pp·dp gloo processes on this machine (no GPU needed), builds the configured model
in the given layout and the one-process reference from the same seed, runs one global batch
through megatron-core's schedule, DDP and Adam, and compares the loss, every gradient shard,
the gradient norm and the updated parameters. The TP mode is the config's ``parallel.mode``
unless ``--mode`` (or the override ``parallel.mode=...``) says otherwise. Prints one line per
check and a final line ``max_rel_loss_diff=<x> max_rel_grad_diff=<y> OK|FAIL``; exits 1 on
FAIL, 2 on a bad layout.
"""

from __future__ import annotations

import argparse

from megatron_boost.cli.arg_types import positive_int, tp_mode
from megatron_boost.cli.errors import one_line_errors


def tiny_model(model: dict, tp: int, layers: int) -> dict:
    """Shrink a model to seconds-on-a-laptop size, keeping its structure (GQA ratio,
    activation, gate SiLU) and making every size divisible by ``tp``."""
    heads = max(4, tp)
    groups = model.get("num_query_groups")
    ratio = (model["num_attention_heads"] // groups) if groups else 1
    groups = max(tp, heads // ratio) if groups else None
    if groups and heads % groups:
        groups = heads
    return dict(model, num_layers=layers, hidden_size=8 * heads, ffn_hidden_size=16 * heads,
                num_attention_heads=heads, num_query_groups=groups, kv_channels=None,
                vocab_size=128, attn_rank=4 * tp, mlp_rank=4 * tp)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-boost-verify-parallel", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument("--tp", type=positive_int, default=1)
    parser.add_argument("--pp", type=positive_int, default=1)
    parser.add_argument("--vpp", type=positive_int, default=None, help="virtual pipeline stages")
    parser.add_argument("--dp", type=positive_int, default=1)
    parser.add_argument("--mode", type=tp_mode, default=None,
                        help="TP mode: full, naive or boost (default: the config's)")
    parser.add_argument("--tiny", action="store_true",
                        help="shrink the model to a few seconds' size, keeping its structure")
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--seq-length", type=positive_int, default=16)
    parser.add_argument("--micro-batch-size", type=positive_int, default=2)
    parser.add_argument("--negative-control", action="store_true",
                        help="corrupt one parameter shard: the check must then FAIL")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.attn_rank=8")
    return parser


def _layout(args):
    """The LayoutSpec of the command line (validated: raises ValueError for a bad one)."""
    from megatron_boost.config.layout import Layout
    from megatron_boost.config.run import load_run_config
    from megatron_boost.testing.verification import LayoutSpec, model_config

    cfg = load_run_config(args.config, args.overrides)
    model = dict(vars(cfg.model))
    if args.tiny:
        model = tiny_model(model, args.tp, max(2, args.pp * (args.vpp or 1)))
    model["seq_length"] = args.seq_length
    layout = Layout(mode=args.mode or cfg.parallel.mode, tp=args.tp, pp=args.pp, vpp=args.vpp)
    spec = LayoutSpec(layout=layout, model=model, seq_length=args.seq_length,
                      micro_batch_size=args.micro_batch_size,
                      global_batch_size=args.micro_batch_size * args.dp * 2,
                      use_distributed_optimizer=args.distributed_optimizer,
                      corrupt=args.negative_control)
    model_config(spec)  # validate here: a bad layout is reported before any process starts
    return spec


def _report(results) -> bool:
    """Print one line per rank and check, and the final line; True when every check passed."""
    from megatron_boost.testing.verification import TOLERANCES

    ok = True
    for rank, r in enumerate(results):
        for check in ("loss", "grad", "grad_norm", "update"):
            if r[check] is None:
                continue
            good = r[check] <= TOLERANCES[check]
            ok &= good
            print(f"rank {rank}: {check:9s} max_rel_diff={r[check]:.3e} "
                  f"(tol {TOLERANCES[check]:.0e}) {'ok' if good else 'FAIL'}")
    loss = max(r["loss"] for r in results if r["loss"] is not None)
    grad = max(r["grad"] for r in results)
    print(f"max_rel_loss_diff={loss:.3e} max_rel_grad_diff={grad:.3e} "
          f"{'OK' if ok else 'FAIL'}")
    return ok


@one_line_errors
def main(argv=None) -> int:
    args = _parser().parse_args(argv)

    from megatron_boost.runtime.spawn import run_distributed
    from megatron_boost.testing.verification import reference_spec, run_layout

    spec = _layout(args)
    world = args.tp * args.pp * args.dp
    print(f"layout: mode={spec.layout.mode} tp={args.tp} pp={args.pp} vpp={args.vpp} "
          f"dp={args.dp} world={world} model={'tiny' if args.tiny else 'as configured'}")
    ref_spec = reference_spec(spec)
    reference = run_distributed(run_layout, 1, ref_spec)[0]
    print(f"reference (one process, {ref_spec.layout.mode}): "
          f"loss={reference['loss']:.6f} grad_norm={reference['grad_norm']:.6f}")
    results = run_distributed(run_layout, world, spec, reference)
    return 0 if _report(results) else 1
