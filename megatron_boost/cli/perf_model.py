"""Cluster performance model CLI: iteration time, per-GPU memory and communication of
full / naive / boost training (the model: :mod:`megatron_boost.perf.model`).

Examples:
    megatron-boost-perf-model --compare-published
    megatron-boost-perf-model --config configs/cola-7b.yaml --gpus 8 --gpu a100-80gb --tp 4
    megatron-boost-perf-model --config configs/cola-7b.yaml --gpus 64 --gpu h100-80gb --recommend
    python tools/perf_model.py --sizing-table --write docs/sizing.md   # every shipped GPU config
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Dict, Optional, Sequence

from megatron_boost.cli.arg_types import mode_list, output_file, positive_int
from megatron_boost.config.modes import TPMode
from megatron_boost.config.shape import ModelShape
from megatron_boost.cli.errors import one_line_errors
from megatron_boost.perf.hardware import HARDWARE, hardware
from megatron_boost.perf.model import RECOMPUTE, Layout, predict
from megatron_boost.perf.published import PUBLISHED_SHAPES, compare_published
from megatron_boost.perf.report import format_prediction, format_published, format_recommend
from megatron_boost.perf.search import recommend


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="perf_model.py",
        description="Predict iteration time, per-GPU memory and communication of full / naive / "
                    "boost training on a GPU cluster (analytical roofline + alpha-beta model).")
    ap.add_argument("--config", help="YAML run config (megatron_boost.config.run); model shape, "
                                     "parallel layout and batch sizes are read from it")
    ap.add_argument("--gpus", type=positive_int,
                    help="GPUs in the cluster (default: tp·pp·dp of the config)")
    ap.add_argument("--gpu", default="a100-80gb", help=f"one of {', '.join(HARDWARE)}")
    ap.add_argument("--gpus-per-node", type=positive_int,
                    help="NVLink domain size (default: per GPU type, 8)")
    ap.add_argument("--tp", type=positive_int)
    ap.add_argument("--pp", type=positive_int)
    ap.add_argument("--vpp", type=positive_int)
    ap.add_argument("--micro-batch-size", type=positive_int)
    ap.add_argument("--seq-length", type=positive_int)
    ap.add_argument("--global-batch-size", type=positive_int)
    ap.add_argument("--recompute", choices=RECOMPUTE)
    ap.add_argument("--distributed-optimizer", action="store_true", default=None)
    ap.add_argument("--modes", type=mode_list, default="full,naive,boost")
    ap.add_argument("--halves", action="store_true",
                    help="boost with parallel.interleave_halves (two halves of the micro-batch "
                         "interleaved through each layer; an even --micro-batch-size)")
    ap.add_argument("--compare-published", action="store_true",
                    help="reproduce the BOOST authors' A100 table (built-in shapes)")
    ap.add_argument("--recommend", action="store_true",
                    help="search TP/PP/micro-batch/recompute per mode for the fastest fits")
    ap.add_argument("--top", type=positive_int, default=3)
    ap.add_argument("--sizing-table", action="store_true",
                    help="the table of docs/sizing.md: every shipped GPU config at its "
                         "intended layout (one 8-GPU node), A100 / H100 / H200")
    ap.add_argument("--paper-layouts", action="store_true",
                    help="the paper-layouts table of docs/sizing.md: every row of the BOOST "
                         "paper's table in every mode at its layout, and the CoLA-shape "
                         "configs at those layouts (flagged where their shape does not divide)")
    ap.add_argument("--write", help="with --sizing-table or --paper-layouts: replace that table in this file "
                                    "(between its markers) instead of printing it")
    ap.add_argument("--json", type=output_file,
                    help="write the results as JSON to this file (checked before predicting)")
    return ap


def _base_setup(args) -> Dict:
    """Shape and layout of the config (or of CoLA/LLaMA-7B on one GPU without one)."""
    if not args.config:
        shape = dataclasses.replace(PUBLISHED_SHAPES["7B"], name="CoLA/LLaMA-7B",
                                    tied_embeddings=False)
        return dict(shape=shape, tp=1, pp=1, vpp=1, mb=1, gb=None, rc="none", dist_opt=False,
                    overlap=True, cfg_dp=None)
    from megatron_boost.config.run import load_run_config  # heavy import (torch): lazy

    cfg = load_run_config(args.config)
    par, tr = cfg.parallel, cfg.training
    return dict(shape=ModelShape.from_config(cfg.model, name=args.config), tp=par.tp,
                pp=par.pp, vpp=par.vpp or 1, mb=tr.micro_batch_size, gb=tr.global_batch_size,
                rc=tr.recompute or "none", dist_opt=par.use_distributed_optimizer,
                overlap=par.overlap_grad_reduce, cfg_dp=par.dp)


def _setup(args) -> Dict:
    """The base setup with the command-line overrides applied; gpus and dp resolved."""
    s = _base_setup(args)
    if args.seq_length:
        s["shape"] = dataclasses.replace(s["shape"], seq_length=args.seq_length)
    for key, flag in (("tp", "tp"), ("pp", "pp"), ("vpp", "vpp"), ("mb", "micro_batch_size"),
                      ("rc", "recompute")):
        s[key] = getattr(args, flag) or s[key]
    if args.distributed_optimizer is not None:
        s["dist_opt"] = args.distributed_optimizer
    s["halves"] = args.halves
    s["gpus"] = args.gpus or (s["tp"] * s["pp"] * (s["cfg_dp"] or 1))
    s["gb"] = args.global_batch_size or s["gb"]
    if not args.recommend:
        if s["gpus"] % (s["tp"] * s["pp"]):
            raise ValueError(f"--gpus {s['gpus']} is not a multiple of tp·pp = "
                             f"{s['tp'] * s['pp']}")
        s["dp"] = s["gpus"] // (s["tp"] * s["pp"])
        if s["gb"] and s["gb"] % (s["mb"] * s["dp"]):
            raise ValueError(f"global batch {s['gb']} is not a multiple of micro-batch "
                             f"{s['mb']} × dp {s['dp']}")
    return s


def _run_config(s: Dict, config: Optional[str]):
    """The RunConfig the trainer would be given for this setup: the config's (or one holding
    the built-in shape), with the layout and batch of the command line."""
    from megatron_boost.config.run import ModelConfig, RunConfig, load_run_config

    if config:
        cfg = load_run_config(config)
    else:
        sh = s["shape"]
        cfg = RunConfig(model=ModelConfig(
            num_layers=sh.num_layers, hidden_size=sh.hidden, ffn_hidden_size=sh.ffn,
            num_attention_heads=sh.heads, num_query_groups=sh.query_groups,
            kv_channels=sh.head_dim, vocab_size=sh.vocab or 32000, attn_rank=sh.attn_rank,
            mlp_rank=sh.mlp_rank))
    cfg.model.seq_length = s["shape"].seq_length or cfg.model.seq_length
    cfg.parallel.tp, cfg.parallel.pp = s["tp"], s["pp"]
    cfg.parallel.vpp = s["vpp"] if s["vpp"] > 1 else None
    cfg.training.micro_batch_size = s["mb"]
    cfg.training.global_batch_size = s["gb"] or s["mb"] * s["dp"]
    return cfg


def check_layouts(s: Dict, modes, config: Optional[str]) -> None:
    """Each mode's layout passes the trainer's own validation pass (the pipeline split, the TP
    split, the ranks, recompute): a prediction for a layout a launch refuses would be
    meaningless. ValueError naming the mode, the layout and the rule."""
    cfg = _run_config(s, config)
    for mode in modes:
        cfg.parallel.mode = mode
        cfg.parallel.sequence_parallel = None  # each mode's default
        if mode is not TPMode.BOOST:
            cfg.parallel.bottleneck_overlap_chunks = 1
        cfg.parallel.interleave_halves = s["halves"] and mode is TPMode.BOOST
        rc = _mode_recompute(s["rc"], mode)
        cfg.training.recompute = None if rc == "none" else rc
        try:
            cfg.validate()
        except ValueError as e:
            raise ValueError(f"{mode} at tp={s['tp']}, pp={s['pp']} is a layout the trainer "
                             f"refuses: {e}") from None


def _mode_recompute(rc: str, mode: TPMode) -> str:
    # the full-rank model has no bottleneck to checkpoint
    return "full" if rc == "lowrank" and mode is TPMode.FULL else rc


def _predictions(s: Dict, modes, hw, gpus_per_node) -> list:
    preds = []
    for mode in modes:
        mrc = _mode_recompute(s["rc"], mode)
        if mrc != s["rc"]:
            print("note: mode full has no bottleneck; recompute lowrank -> full")
        lay = Layout(mode=mode, tp=s["tp"], pp=s["pp"], dp=s["dp"], micro_batch=s["mb"],
                     global_batch=s["gb"], recompute=mrc, vpp=s["vpp"],
                     distributed_optimizer=s["dist_opt"], overlap_grad_reduce=s["overlap"],
                     gpus_per_node=gpus_per_node,
                     interleave_halves=s["halves"] and mode is TPMode.BOOST)
        pr = predict(s["shape"], lay, hw)
        print(format_prediction(pr))
        preds.append(pr.to_dict())
    return preds


def _sizing_table(write: Optional[str], paper_layouts: bool = False) -> int:
    from pathlib import Path

    from megatron_boost.perf import sizing

    root = Path(__file__).resolve().parents[2]
    if paper_layouts:
        table, what = sizing.paper_layouts_table(root), "paper-layouts table"
        markers = (sizing.PAPER_BEGIN, sizing.PAPER_END)
    else:
        table, what = sizing.sizing_table(sizing.sizing_configs(root / "configs"), root), \
            "sizing table"
        markers = (sizing.BEGIN, sizing.END)
    if not write:
        print(table, end="")
        return 0
    path = Path(write)
    if not path.is_file():
        raise ValueError(f"--write '{write}' is not an existing file; give the Markdown file "
                         f"whose {what} to replace (e.g. docs/sizing.md)")
    path.write_text(sizing.replace_table(path.read_text(), table, *markers))
    print(f"wrote the {what} into {write}")
    return 0


@one_line_errors
def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.write and not (args.sizing_table or args.paper_layouts):
        parser.error(f"--write '{args.write}' replaces a table of a Markdown file: give it "
                     f"with --sizing-table or --paper-layouts")
    hw = hardware(args.gpu)
    modes = args.modes
    if args.sizing_table or args.paper_layouts:
        return _sizing_table(args.write, paper_layouts=args.paper_layouts)
    result: Dict = {"gpu": hw.name, "hardware": dataclasses.asdict(hw)}
    if args.compare_published:
        rows = compare_published()
        print(format_published(rows))
        result["published_comparison"] = rows
    if args.config or args.recommend or not args.compare_published:
        s = _setup(args)
        if args.recommend:
            res = recommend(s["shape"], s["gpus"], hw, modes=modes, global_batch=s["gb"],
                            top=args.top, gpus_per_node=args.gpus_per_node)
            print(format_recommend(res, s["shape"], s["gpus"], hw))
            result["recommend"] = {m: [p.to_dict() for p in ps] for m, ps in res.items()}
        else:
            check_layouts(s, modes, args.config)
            result["predictions"] = _predictions(s, modes, hw, args.gpus_per_node)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2)
        print(f"wrote {args.json}")
    return 0
