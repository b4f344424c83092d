"""Text formatting of the cluster performance model's results. Every figure is the analytical
model's prediction, not a measurement, and each block says so; ``mb`` is the micro-batch size
and ``m`` the number of micro-batches per optimizer step (global batch / (mb · dp))."""

from __future__ import annotations

from typing import Dict, List

from megatron_boost.config.shape import MODES, ModelShape
from megatron_boost.perf.hardware import HardwareSpec
from megatron_boost.perf.model import Prediction
from megatron_boost.perf.published import FIT_MODES

__all__ = ["format_published", "format_recommend", "format_prediction", "LAYOUT_LEGEND"]

#: What the layout's abbreviations mean, printed with them.
LAYOUT_LEGEND = "mb = micro-batch size, m = micro-batches per step"


def format_published(rows: List[Dict]) -> str:
    r0 = rows[0]
    out = [f"BOOST authors' A100 table vs this model ({r0['gpu']}, {r0['gpus_per_node']} "
           "GPUs/node; micro-batch 4, seq 4096, bf16, dp=1, 1 micro-batch/step): iteration s",
           f"{'model':<6}{'GPUs':>5}{'TP':>4}{'PP':>4}  "
           + "".join(f"{m + ' pred/pub (ratio)':>27}" for m in MODES)]
    by_model: Dict[str, Dict[str, Dict]] = {}
    for r in rows:
        by_model.setdefault(r["model"], {})[r["mode"]] = r
    for name, cells in by_model.items():
        r0 = next(iter(cells.values()))
        line = f"{name:<6}{r0['gpus']:>5}{r0['tp']:>4}{r0['pp']:>4}  "
        for mode in MODES:
            c = cells[mode]
            flag = ("" if c["within_15pct"] else "*") + ("" if c["fits"] else "!")
            line += (f"{c['predicted_s']:>10.3f} / {c['published_s']:<5.2f}"
                     f"({c['ratio']:.2f}){flag:2}")
        out.append(line)
    fitted = [r for r in rows if r["mode"] in FIT_MODES]
    boost = [r["ratio"] for r in rows if r["mode"] not in FIT_MODES]
    out.append(f"{sum(r['within_15pct'] for r in fitted)}/{len(fitted)} full and naive cells "
               f"(the fit's) within ±15 %  (* = outside; ! = this model's memory estimate "
               f"exceeds the GPU: " + ", ".join(
                   f"{r['model']} {r['mode']} {r['memory_gb']:.0f} GB" for r in rows
                   if not r["fits"]) + ")")
    out.append(f"boost predicted from our layer's op ledger, not fitted: predicted/published "
               f"{min(boost):.2f} to {max(boost):.2f}")
    speed = []
    for name, cells in by_model.items():
        pf, pn, pb = (cells[m]["predicted_s"] for m in MODES)
        qf, qn, qb = (cells[m]["published_s"] for m in MODES)
        speed.append(f"{name}: boost vs full {pf / pb:.2f}x (pub {qf / qb:.2f}x), "
                     f"vs naive {pn / pb:.2f}x (pub {qn / qb:.2f}x)")
    out.extend(speed)
    return "\n".join(out)


def format_recommend(res: Dict[str, List[Prediction]], shape: ModelShape, gpus: int,
                     hw: HardwareSpec) -> str:
    gb = next((p.layout["global_batch"] for ps in res.values() for p in ps), None)
    lines = [f"Fastest layouts that fit, predicted (not measured): {shape.name} on {gpus} x "
             f"{hw.name} ({hw.memory_gb:.0f} GB, seq {shape.seq_length}, global batch {gb}); "
             f"{LAYOUT_LEGEND}"]
    for mode, preds in res.items():
        lines.append(f"[{mode}]")
        if not preds:
            lines.append("  nothing fits")
        for pr in preds:
            L = pr.layout
            lines.append(
                f"  tp={L['tp']} pp={L['pp']} dp={L['dp']} mb={L['micro_batch']} "
                f"m={L['num_micro_batches']:<3} recompute={L['recompute']:<9} "
                f"predicted: iter={pr.iteration_s:7.3f}s  tok/s/GPU={pr.tokens_per_s_per_gpu:9.0f}  "
                f"mem={pr.memory_gb['total']:6.1f} GB  MFU={pr.mfu:.2f}")
    return "\n".join(lines)


def format_prediction(pr: Prediction) -> str:
    L = pr.layout
    c = pr.comm
    lines = [
        f"[{pr.mode}] predicted (not measured) for {pr.model} on "
        f"{L['tp'] * L['pp'] * L['dp']} x {pr.gpu}: tp={L['tp']} pp={L['pp']} dp={L['dp']} "
        f"mb={L['micro_batch']} m={L['num_micro_batches']} recompute={L['recompute']} "
        f"({LAYOUT_LEGEND})",
        f"  predicted iteration {pr.iteration_s:.3f} s   tokens/s/GPU "
        f"{pr.tokens_per_s_per_gpu:.0f}   MFU {pr.mfu:.2f}",
        "  predicted time (s): " + ", ".join(f"{k} {v:.3f}" for k, v in pr.breakdown_s.items()
                                           if v),
        "  predicted memory (GB per GPU): " + ", ".join(
            f"{k} {v:.2f}" for k, v in pr.memory_gb.items())
        + f"  ({'fits' if pr.fits else 'DOES NOT FIT'})",
        f"  comm (counted):   TP per layer per token fwd {c['tp_elements_per_token_per_layer_fwd']:.0f} / "
        f"bwd {c['tp_elements_per_token_per_layer_bwd']:.0f} elements "
        f"({c['tp_bytes_per_layer_fwd'] / 2**30:.3f} / {c['tp_bytes_per_layer_bwd'] / 2**30:.3f}"
        f" GiB per layer, {c['tp_collectives_per_layer']} collectives, {c['tp_link']}); "
        f"DP grads {c['dp_gradient_bytes'] / 1e9:.2f} GB; PP p2p "
        f"{c['pp_p2p_bytes_per_microbatch'] / 1e6:.1f} MB/micro-batch",
    ]
    return "\n".join(lines)
