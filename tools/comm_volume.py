#!/usr/bin/env python
"""Per-decoder-layer tensor-parallel communication of full, naive and boost: measured and formula.

    python tools/comm_volume.py --config configs/cola-7b.yaml --micro-batch-size 4 \\
        --seq-length 4096 --tp 4 --dtype bf16 [--json out.json]

For each mode, spawns ``tp`` gloo processes that build ONE megatron-core TransformerLayer from
``megatron_boost.model.gpt.get_layer_spec`` (naive: attention and MLP on the one-rank decoder group,
bottlenecks on the real TP group, as BottleneckGPTModel builds it) at the config's real widths,
run it forward and backward on a small number of tokens (default 8·tp, micro-batch 1) under
``comm.record_collectives`` and record every TP collective. Every activation collective of a
layer carries tokens × width elements, so the measured bytes per token are an exact integer and
are scaled exactly to B·S tokens. The formula of DESIGN.md's table is printed beside it
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
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fmt_bytes(n: float) -> str:
    return f"{n / 2 ** 30:.4f} GiB"


def print_report(report: dict, out=sys.stdout) -> None:
    st = report["setting"]
    w = out.write
    w(f"per-layer TP communication  d={st['d']} f={st['f']} h={st['h']} g={st['g']} "
      f"e={st['e']} r_attn={st['r_attn']} r_mlp={st['r_mlp']}  B={st['micro_batch_size']} "
      f"S={st['seq_length']} ({st['tokens']} tokens)  {st['dtype']} "
      f"({st['element_size']} B/elem)  TP={st['tp']}\n")
    hdr = (f"{'mode':6} {'dir':4} {'formula':>18} {'elem/tok':>9} {'n':>3} "
           f"{'formula bytes':>14} {'measured bytes':>15} {'n':>3} {'GiB':>8} {'match':>6}")
    w(hdr + "\n" + "-" * len(hdr) + "\n")
    for mode, e in report["modes"].items():
        f, m = e["formula"], e.get("measured")
        for d in ("fwd", "bwd"):
            mb = "-" if m is None else f"{m[d + '_bytes']:,}"
            mn = "-" if m is None else str(m[d + "_count"])
            ok = "-" if m is None else ("yes" if (m[d + "_bytes"] == f[d + "_bytes"]
                                                  and m[d + "_count"] == f[d + "_count"])
                                        else "NO")
            w(f"{mode:6} {d:4} {f[d]:>18} {f[d + '_elems_per_token']:>9} "
              f"{f[d + '_count']:>3} {f[d + '_bytes']:>14,} {mb:>15} {mn:>3} "
              f"{f[d + '_bytes'] / 2 ** 30:>8.4f} {ok:>6}\n")
    if any("measured" in e for e in report["modes"].values()):
        e0 = next(e for e in report["modes"].values() if "measured" in e)
        w(f"measured at {e0['measured']['measure_tokens']} tokens per layer and scaled "
          f"exactly (bytes/token × {st['tokens']}); widths per collective:\n")
        for mode, e in report["modes"].items():
            if "measured" in e:
                w(f"  {mode:6} fwd {e['measured']['fwd_widths']}  "
                  f"bwd {e['measured']['bwd_widths']}\n")
    if any("published_fwd" in e for e in report["modes"].values()):
        w("published anchor (BOOST README, LLaMA-7B, B=4, S=4096, bf16, forward, one layer):\n")
        for mode, e in report["modes"].items():
            p = e["published_fwd"]
            w(f"  {mode:6} published {p['value']:.2f} 'GB'   ours {p['ours_gib']:.4f} GiB "
              f"({p['rel_diff_gib']:+.1%})   = {p['ours_gb']:.4f} GB "
              f"({p['rel_diff_gb']:+.1%})\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument("--micro-batch-size", type=int, default=None,
                        help="B (default: the config's training.micro_batch_size)")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="S (default: the config's model.seq_length)")
    parser.add_argument("--tp", type=int, default=None, help="TP size (default: the config's)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                        help="activation dtype (default: the config's precision; auto -> bf16)")
    parser.add_argument("--modes", default="full,naive,boost")
    parser.add_argument("--measure-tokens", type=int, default=None,
                        help="tokens of the measured layer run (default 8·tp, micro-batch 1)")
    parser.add_argument("--formula-only", action="store_true", help="skip the measurement")
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.attn_rank=8")
    args = parser.parse_args(argv)

    from dataclasses import asdict

    from megatron_boost.analysis.accounting import LayerCommSpec, comm_volume_report, layer_comm_worker
    from megatron_boost.runtime.spawn import run_distributed
    from megatron_boost.config.run import load_run_config, to_transformer_config

    cfg = load_run_config(args.config, args.overrides)
    tp = args.tp or cfg.parallel.tp
    mb = args.micro_batch_size or cfg.training.micro_batch_size
    seq = args.seq_length or cfg.model.seq_length
    dtype = args.dtype or ("fp32" if cfg.training.precision == "fp32" else "bf16")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for mode in modes:  # validate every mode's divisibility at this TP before spawning
        cfg.parallel.mode, cfg.parallel.tp = mode, tp
        try:
            to_transformer_config(cfg)
        except ValueError as e:
            print(f"error: {mode} mode at TP={tp}: {e}", file=sys.stderr)
            return 2
    measured = None
    if not args.formula_only and tp > 1:
        tokens = args.measure_tokens or 8 * tp
        model = asdict(cfg.model)
        specs = [LayerCommSpec(model=model, mode=m, tp=tp, seq_length=tokens,
                               micro_batch_size=1, dtype=dtype) for m in modes]
        results = run_distributed(layer_comm_worker, tp, specs, timeout=1800)
        measured = {r["mode"]: r for r in results[0]}
        # Every rank issues the same collectives; check it.
        for rank_results in results[1:]:
            for a, b in zip(results[0], rank_results):
                if (a["fwd"], a["bwd"]) != (b["fwd"], b["bwd"]):
                    print(f"warning: ranks disagree on {a['mode']}", file=sys.stderr)
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


if __name__ == "__main__":
    sys.exit(main())
