"""Per-decoder-layer tensor-parallel communication of full, naive and boost: measured and formula.

    megatron-boost-comm-volume --config configs/cola-7b.yaml --micro-batch-size 4 \\
        --seq-length 4096 --tp 4 --dtype bf16 [--json out.json]

For each mode, spawns ``tp`` gloo processes that build ONE megatron-core TransformerLayer from
``megatron_boost.model.specs.get_layer_spec`` (naive: attention and MLP on the one-rank decoder group,
bottlenecks on the real TP group, as BottleneckGPTModel builds it) at the config's real widths,
run it forward and backward on a small number of tokens (default 8·tp, micro-batch 1) under
``record_collectives`` and record every TP collective. Every activation collective of a
layer carries tokens × width elements, so the measured bytes per token are an exact integer and
are scaled exactly to B·S tokens. The formula of docs/design.md §5's table is printed beside it
(full 2d / 2d, naive 5d + 2f / 3d + f, boost 7r + 2 / 7r for MHA; GQA and separate ranks are
handled). Mode full is the full-rank twin: the same config with parallel.mode=full (ranks are
ignored).

Units: bytes; "GiB" = 2**30 bytes, "GB" = 1e9 bytes. For CoLA-7B at B=4, S=4096, bf16 the BOOST
authors' per-layer forward figures (full 0.25, vanilla 1.32, BTP 0.22 "GB") are printed beside
ours in both units: they are GiB (full-rank 8192·16384·2 B = 0.250 GiB = 0.268 GB).

Measuring the 7B layer at TP=4 takes about 15 s of compute per process and < 1 GB of memory
per process in bf16 (the full-rank layer's initialisation dominates). ``--formula-only`` skips
the measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Dict, List, Optional, Sequence

from megatron_boost.cli.arg_types import mode_list, positive_int
from megatron_boost.cli.errors import one_line_errors


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-boost-comm-volume", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument("--micro-batch-size", type=positive_int, default=None,
                        help="B (default: the config's training.micro_batch_size)")
    parser.add_argument("--seq-length", type=positive_int, default=None,
                        help="S (default: the config's model.seq_length)")
    parser.add_argument("--tp", type=positive_int, default=None,
                        help="TP size (default: the config's)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                        help="activation dtype (default: the config's precision; auto -> bf16)")
    parser.add_argument("--modes", type=mode_list, default="full,naive,boost")
    parser.add_argument("--measure-tokens", type=positive_int, default=None,
                        help="tokens of the measured layer run (default 8·tp, micro-batch 1)")
    parser.add_argument("--formula-only", action="store_true", help="skip the measurement")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.attn_rank=8")
    return parser


def _invalid_mode(cfg, modes: Sequence[str], tp: int) -> Optional[str]:
    """The first mode the config rejects at this TP (checked before spawning), or None."""
    from megatron_boost.config.resolved import check_model_rules

    for mode in modes:
        cfg.parallel.mode, cfg.parallel.tp = mode, tp
        try:
            check_model_rules(cfg)
        except ValueError as e:
            return f"{mode} mode at TP={tp}: {e}"
    return None


def _measure(cfg, modes: List[str], tp: int, tokens: int, dtype: str) -> Dict[str, Dict]:
    """Per mode, rank 0's measured layer communication; warns when the ranks disagree."""
    from megatron_boost.config.layout import Layout
    from megatron_boost.measure.layer_comm import LayerCommSpec, layer_comm_worker
    from megatron_boost.runtime.spawn import run_distributed

    model = asdict(cfg.model)
    specs = [LayerCommSpec(model=model, layout=Layout(mode=m, tp=tp), seq_length=tokens,
                           micro_batch_size=1, dtype=dtype) for m in modes]
    results = run_distributed(layer_comm_worker, tp, specs, timeout=1800)
    # Every rank issues the same collectives; check it.
    for rank_results in results[1:]:
        for a, b in zip(results[0], rank_results):
            if (a["fwd"], a["bwd"]) != (b["fwd"], b["bwd"]):
                print(f"warning: ranks disagree on {a['mode']}", file=sys.stderr)
    return {r["mode"]: r for r in results[0]}


@one_line_errors
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_boost.analysis.comm_report import comm_volume_report, print_report
    from megatron_boost.config.run import load_run_config

    cfg = load_run_config(args.config, args.overrides)
    tp = args.tp or cfg.parallel.tp
    mb = args.micro_batch_size or cfg.training.micro_batch_size
    seq = args.seq_length or cfg.model.seq_length
    dtype = args.dtype or ("fp32" if cfg.training.precision == "fp32" else "bf16")
    modes = args.modes
    error = _invalid_mode(cfg, modes, tp)
    if error:
        raise ValueError(error)
    measured = None
    if not args.formula_only and tp > 1:
        measured = _measure(cfg, modes, tp, args.measure_tokens or 8 * tp, dtype)
    elif tp == 1:
        print("TP=1: no tensor-parallel collectives; formula only", file=sys.stderr)
    report = comm_volume_report(cfg, mb, seq, tp, dtype, measured=measured, modes=modes)
    print_report(report)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    mismatch = [m for m, e in report["modes"].items() if e.get("match") is False]
    if mismatch:
        print(f"MISMATCH measured vs formula: {mismatch}")
        return 1
    return 0
