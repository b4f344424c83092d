"""The per-layer op ledger of full, naive and boost: kernels, bytes, GEMM FLOPs, collectives and
saved activations of one decoder layer on one TP rank, at a config's real per-rank shapes
(docs/design.md §17).

    megatron-boost-layer-ops --config configs/paper-7b.yaml [--tp 4] [--modes full,naive,boost]
        [--micro-batch-size 4] [--seq-length 4096] [--dtype bf16] [--chunks 2]
        [--recompute lowrank] [--profile h100-sxm] [--halves] [--kernels] [--json out.json]
        [overrides ...]

Each mode's layer is built exactly as the model builds it, from FakeTensors (real shapes, dtypes
and strides, no memory), on rank 0 of a fake TP group of ``tp`` ranks: a 7B layer at 16384
tokens is measured at its full size, exactly, in seconds, allocating nothing of that size. The
kernels are those a CUDA run launches: each of the layers' fused regions (megatron's jit_fuser
compiles it on CUDA) and each stand-in for a fused kernel of megatron's or Transformer Engine's
(RoPE, RMSNorm, SwiGLU, flash attention) counts once; the CPU's eager count is beside it.

``full`` is the BOOST paper's full-rank baseline (all-reduce TP), ``full+sp`` megatron's own
(sequence parallelism). Printed per layer: kernels (the CPU's eager count in brackets), GEMMs and their TFLOP, the
elementwise + copy traffic forward / backward (and outside the attention core and RoPE, which
every mode shares), the layout copies outside attention, the collectives (exposed: synchronous,
or waited for before any GEMM could run beside them), the saved activations and the fp32 ones
one value per token wider; then each mode's collectives and where its saved bytes come from.
Then the layers in time at a device profile (``--profile``, ``perf/layer_time.py``): the
kernels on one compute stream and the collectives on one communication stream, a collective
hidden only by work issued beside it that does not read its result; GEMM, attention, memory
traffic and exposed communication time, and the total over the FLOP time (GEMMs + attention).
``--halves`` measures boost with ``parallel.interleave_halves`` (two halves of the micro-batch
interleaved through the layer, ``parallel/interleave.py``).
``--kernels`` lists every kernel. Units: GB = 1e9 bytes, GiB = 2**30.
"""

from __future__ import annotations

import argparse
from typing import List, Optional, Sequence

from megatron_boost.cli.arg_types import layer_mode_list, output_file, positive_int
from megatron_boost.cli.errors import one_line_errors
from megatron_boost.cli.mode_labels import layout_of
from megatron_boost.config.modes import TPMode


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatron-boost-layer-ops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML run config")
    parser.add_argument("--modes", type=layer_mode_list, default="full,naive,boost",
                        help="layers to measure: full (the BOOST paper's full-rank baseline, "
                             "no sequence parallelism), full+sp (megatron's), naive, boost")
    parser.add_argument("--tp", type=positive_int, default=None,
                        help="TP size (default: the config's)")
    parser.add_argument("--micro-batch-size", type=positive_int, default=None,
                        help="B (default: the config's training.micro_batch_size)")
    parser.add_argument("--seq-length", type=positive_int, default=None,
                        help="S (default: the config's model.seq_length)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default=None,
                        help="activation dtype (default: the config's precision; auto -> bf16)")
    parser.add_argument("--chunks", type=positive_int, default=None,
                        help="boost: parallel.bottleneck_overlap_chunks (default: the config's)")
    parser.add_argument("--recompute", choices=["none", "lowrank"], default="none",
                        help="the layer's recompute (lowrank: the bottleneck modes only)")
    parser.add_argument("--profile", choices=list(_profiles()), default=_profiles()[0],
                        help="device profile of the time table (perf/layer_time.py)")
    parser.add_argument("--halves", action="store_true",
                        help="boost: parallel.interleave_halves (two halves of the micro-batch "
                             "interleaved through the layer)")
    parser.add_argument("--kernels", action="store_true", help="list every kernel")
    parser.add_argument("--json", type=output_file, default=None,
                        help="write the ledgers here (checked before measuring)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.mlp_rank=512")
    return parser


def _profiles() -> List[str]:
    from megatron_boost.perf.layer_time import DEFAULT_PROFILE, DEVICE_PROFILES

    return [DEFAULT_PROFILE] + [p for p in DEVICE_PROFILES if p != DEFAULT_PROFILE]


def time_lines(ledgers, profile: str) -> List[str]:
    """The layers' time table at ``profile`` and each collective's exposed time."""
    from megatron_boost.measure.ledger import spec_label
    from megatron_boost.perf.layer_time import layer_time, profile_costs, time_table

    timed = [(spec_label(lg.spec), layer_time(lg, profile_costs(profile, lg.spec.layout.tp)))
             for lg in ledgers]
    lines = ["", f"in time at {profile} (ms; one compute and one communication stream):",
             time_table(timed, profile)]
    for label, t in timed:
        rows = ", ".join(f"{r['phase']} {r['scope']} {r['exposed_s'] * 1e3:.3f}/"
                         f"{r['link_s'] * 1e3:.3f}" for r in t.collectives)
        lines.append(f"{label}: collectives exposed/on the link ms: {rows}")
    return lines


def ledger_specs(cfg, modes: Sequence[str], tp: int, micro_batch: int, seq_length: int,
                 dtype: str, chunks: int, recompute: Optional[str], halves: bool = False
                 ) -> List:
    """One :class:`~megatron_boost.measure.ledger.LedgerSpec` per mode; ValueError naming the
    rule a mode breaks at this layout (checked before anything is built)."""
    from megatron_boost.config.layout import Layout
    from megatron_boost.measure.ledger import LedgerSpec
    from megatron_boost.config.shape import ModelShape

    specs = []
    for label in modes:
        labelled = layout_of(label)  # the label's mode, sequence parallelism, fused SwiGLU
        mode = labelled.mode
        cfg.parallel.mode, cfg.parallel.tp = mode, tp
        cfg.parallel.sequence_parallel = labelled.sequence_parallel
        cfg.parallel.bottleneck_overlap_chunks = chunks if mode is TPMode.BOOST else 1
        cfg.parallel.interleave_halves = halves and mode is TPMode.BOOST
        if cfg.parallel.interleave_halves:  # the halves split the measured micro-batch
            cfg.training.micro_batch_size = cfg.training.global_batch_size = micro_batch
        cfg.training.recompute = recompute if mode.is_lowrank else None
        try:
            cfg.validate()  # the trainer's one pass: the TP split, the ranks
        except ValueError as e:
            raise ValueError(f"{label} at TP={tp}: {e}") from None
        specs.append(LedgerSpec(shape=ModelShape.from_config(cfg, "config"),
                                layout=Layout(mode=mode, tp=tp, sequence_parallel=bool(
                                    labelled.sequence_parallel) and tp > 1),
                                micro_batch=micro_batch, seq_length=seq_length, dtype=dtype,
                                bias_activation_fusion=cfg.model.bias_activation_fusion,
                                overlap_chunks=cfg.parallel.bottleneck_overlap_chunks,
                                interleave_halves=cfg.parallel.interleave_halves,
                                recompute=cfg.training.recompute))
    return specs


#: The table's columns (measure/ledger.py's ledger_table) in words, printed under it so the
#: table reads without --help.
COLUMNS = {
    "kernels fwd+bwd (CPU eager)": "kernels a GPU launches forward and backward (the CPU's "
                                   "eager count in brackets)",
    "GEMMs": "matrix multiplies among them",
    "GEMM TFLOP": "their work",
    "elementwise+copy GB (fwd / bwd)": "bytes the other kernels read and write",
    "outside attention GB": "the same without the attention core and RoPE, which every mode "
                            "shares",
    "layout copies outside attention": "transposes/contiguous copies there",
    "collectives (exposed: count, MiB)": "TP collectives (exposed: not hidden behind a GEMM)",
    "saved GiB": "activations kept for backward",
    "fp32 [T, >1] saved GiB": "of those, fp32 tensors wider than one value per token",
}


def _legend() -> str:
    return ("columns (counted from the layer's op graph, not timed; GB = 1e9 bytes, GiB = "
            "2**30): " + "; ".join(f"{name}: {what}" for name, what in COLUMNS.items()))


def _header(spec, path: str) -> str:
    s, t = spec.shape, spec.layout.tp
    return (f"op ledger of one decoder layer on TP rank 0 of {t}: {path}, micro-batch "
            f"{spec.micro_batch} x seq {spec.seq_length} = {spec.micro_batch * spec.seq_length}"
            f" tokens, {spec.dtype}; d={s.hidden} f={s.ffn} heads={s.heads} "
            f"r_attn={s.r_attn} r_mlp={s.r_mlp}")


def _details(ledger) -> List[str]:
    gib = 2 ** 30
    from megatron_boost.measure.ledger import spec_label

    name = f"{spec_label(ledger.spec)} tp={ledger.spec.layout.tp}"
    lines = [f"{name}: collectives (phase kind scope width MiB async exposed overlapping-GEMM "
             f"TFLOP)"]
    for c in ledger.collectives:
        lines.append(f"  {c.phase} {c.kind} {c.scope} {c.width} {c.bytes / 2 ** 20:.1f} "
                     f"{'async' if c.async_op else 'sync'} {'exposed' if c.exposed else '-'} "
                     f"{c.overlap_flops / 1e12:.3f}")
    saved = ", ".join(f"{scope} {n / gib:.3f}" for scope, n in
                      sorted(ledger.saved_by_scope.items(), key=lambda kv: -kv[1]))
    lines.append(f"{name}: saved GiB by module: {saved}")
    return lines


def _kernel_lines(ledger) -> List[str]:
    from megatron_boost.measure.ledger import spec_label

    out = [f"{spec_label(ledger.spec)} tp={ledger.spec.layout.tp}: kernels (phase kind name "
           f"scope MB GFLOP eager shapes)"]
    for k in ledger.kernels:
        out.append(f"  {k.phase} {k.kind} {k.name} {k.scope} {k.bytes / 1e6:.1f} "
                   f"{k.flops / 1e9:.1f} {k.eager_kernels} {list(k.shapes)}")
    return out


def check_halves(modes: Sequence[str], micro_batch: int) -> None:
    """ValueError unless ``--halves`` has a boost layer and an even micro-batch to split."""
    if TPMode.BOOST not in [layout_of(label).mode for label in modes]:
        raise ValueError(f"--halves measures boost's layer; --modes {','.join(modes)} has no "
                         f"boost: add boost to --modes")
    if micro_batch % 2:
        raise ValueError(f"--halves splits the micro-batch in two; micro-batch size "
                         f"{micro_batch} is odd: pass an even --micro-batch-size")


@one_line_errors
def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    import warnings

    warnings.filterwarnings("ignore")  # megatron's CPU notices would bury the table
    from megatron_boost.measure.ledger import layer_ledger, ledger_json, ledger_table
    from megatron_boost.config.run import load_run_config

    cfg = load_run_config(args.config, args.overrides)
    dtype = args.dtype or ("fp32" if cfg.training.precision == "fp32" else "bf16")
    micro_batch = args.micro_batch_size or cfg.training.micro_batch_size
    if args.halves:
        check_halves(args.modes, micro_batch)
    specs = ledger_specs(cfg, args.modes, args.tp or cfg.parallel.tp,
                         micro_batch,
                         args.seq_length or cfg.model.seq_length, dtype,
                         args.chunks or cfg.parallel.bottleneck_overlap_chunks,
                         None if args.recompute == "none" else args.recompute, args.halves)
    ledgers = [layer_ledger(spec) for spec in specs]
    print(_header(specs[0], args.config))
    print(ledger_table(ledgers))
    print(_legend())
    print("\n".join(time_lines(ledgers, args.profile)))
    for ledger in ledgers:
        print("\n".join(_details(ledger)))
        if args.kernels:
            print("\n".join(_kernel_lines(ledger)))
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(ledger_json(ledgers))
    return 0
