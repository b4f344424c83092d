"""The per-layer TP communication report of ``megatron-boost-comm-volume``: formula and
measurement per mode for one micro-batch, beside the BOOST authors' published figures.

Units: bytes are bytes; :data:`GIB` = 2**30 bytes. The BOOST authors' "GB" figures for one
CoLA-7B layer are GiB (docs/design.md §5).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Sequence, TextIO

from megatron_boost.analysis.comm import layer_comm_formula
from megatron_boost.config.shape import MODES, ModelShape
from megatron_boost.config.modes import TPMode

__all__ = ["GIB", "DTYPE_BYTES", "PUBLISHED_7B_FWD", "PUBLISHED_7B_SETTING",
           "comm_volume_report", "print_report"]

GIB = 2 ** 30
DTYPE_BYTES = {"fp32": 4, "bf16": 2}

#: The BOOST authors' per-layer forward TP communication of LLaMA-7B (d 4096, f 11008, r 1024,
#: MHA), micro-batch 4, seq 4096, bf16, one layer, in their README's "GB" (which are GiB: see
#: :func:`comm_volume_report`).
PUBLISHED_7B_FWD = {TPMode.FULL: 0.25, TPMode.NAIVE: 1.32, TPMode.BOOST: 0.22}
PUBLISHED_7B_SETTING = {"d": 4096, "f": 11008, "h": 32, "g": 32, "r_attn": 1024,
                        "r_mlp": 1024, "micro_batch_size": 4, "seq_length": 4096,
                        "dtype": "bf16"}


def _setting(shape: ModelShape) -> Dict[str, Any]:
    return {"d": shape.hidden, "f": shape.ffn, "h": shape.heads, "g": shape.g, "e": shape.e,
            "r_attn": shape.attn_rank, "r_mlp": shape.mlp_rank}


def _formula_entry(f: Dict[str, Any], tokens: int, esize: int) -> Dict[str, Any]:
    return {"fwd": f["fwd_formula"], "bwd": f["bwd_formula"],
            "fwd_elems_per_token": f["fwd_elems_per_token"],
            "bwd_elems_per_token": f["bwd_elems_per_token"],
            # the fp32 statistic columns are 4 bytes whatever the activation dtype
            "fwd_bytes": (f["fwd_elems_per_token"] * esize
                          + f["fwd_fp32_columns"] * (4 - esize)) * tokens,
            "bwd_bytes": f["bwd_elems_per_token"] * tokens * esize,
            "fwd_count": f["fwd_count"], "bwd_count": f["bwd_count"],
            "fwd_widths": f["fwd_widths"], "bwd_widths": f["bwd_widths"]}


def _measured_entry(m: Dict[str, Any], tokens: int) -> Dict[str, Any]:
    """A :func:`~megatron_boost.measure.layer_comm.layer_comm_worker` result scaled exactly to
    ``tokens`` (bytes_per_token · B · S)."""
    return {"measure_tokens": m["tokens"], "element_size": m["element_size"],
            "fwd_bytes_per_token": m["fwd"]["bytes_per_token"],
            "bwd_bytes_per_token": m["bwd"]["bytes_per_token"],
            "fwd_bytes": m["fwd"]["bytes_per_token"] * tokens,
            "bwd_bytes": m["bwd"]["bytes_per_token"] * tokens,
            "fwd_count": m["fwd"]["count"], "bwd_count": m["bwd"]["count"],
            "fwd_widths": m["fwd"]["widths"], "bwd_widths": m["bwd"]["widths"]}


def _published_entry(mode: str, fwd_bytes: int) -> Dict[str, float]:
    pub = PUBLISHED_7B_FWD[mode]
    return {"value": pub, "ours_gib": fwd_bytes / GIB, "ours_gb": fwd_bytes / 1e9,
            "rel_diff_gib": fwd_bytes / GIB / pub - 1.0,
            "rel_diff_gb": fwd_bytes / 1e9 / pub - 1.0}


def comm_volume_report(cfg: Any, micro_batch_size: int, seq_length: int, tp: int,
                       dtype: str = "bf16", measured: Optional[Dict[str, Dict]] = None,
                       modes: Sequence[str] = MODES) -> Dict[str, Any]:
    """Per-layer TP communication of one micro-batch (B·S tokens) for each mode.

    ``measured``: per mode, a :func:`~megatron_boost.measure.layer_comm.layer_comm_worker` result
    (bytes per token measured at a small token count); its bytes are scaled exactly. Without it
    only the formula is reported. The published 7B anchor is attached when the shape, batch and
    dtype are the authors' (see PUBLISHED_7B_SETTING)."""
    shape = cfg if isinstance(cfg, ModelShape) else ModelShape.from_config(cfg)
    tokens = micro_batch_size * seq_length
    esize = DTYPE_BYTES[dtype]
    setting = {**_setting(shape), "micro_batch_size": micro_batch_size,
               "seq_length": seq_length, "dtype": dtype}
    anchor = all(setting.get(k) == v for k, v in PUBLISHED_7B_SETTING.items())
    report: Dict[str, Any] = {"setting": {**setting, "tp": tp, "tokens": tokens,
                                          "element_size": esize},
                              "modes": {}}
    for mode in modes:
        entry: Dict[str, Any] = {
            "formula": _formula_entry(layer_comm_formula(shape, mode, dtype), tokens, esize)}
        if measured is not None and mode in measured:
            entry["measured"] = _measured_entry(measured[mode], tokens)
            entry["match"] = all(entry["measured"][k] == entry["formula"][k] for k in (
                "fwd_bytes", "bwd_bytes", "fwd_count", "bwd_count"))
        if anchor:
            entry["published_fwd"] = _published_entry(mode, entry["formula"]["fwd_bytes"])
        report["modes"][mode] = entry
    return report


def _print_rows(report: dict, w) -> None:
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
              f"{f[d + '_bytes'] / GIB:>8.4f} {ok:>6}\n")


def _print_measured_and_anchor(report: dict, w) -> None:
    st = report["setting"]
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


def print_report(report: dict, out: Optional[TextIO] = None) -> None:
    """Print a :func:`comm_volume_report` as the comm-volume table."""
    w = (out or sys.stdout).write
    st = report["setting"]
    w(f"per-layer TP communication  d={st['d']} f={st['f']} h={st['h']} g={st['g']} "
      f"e={st['e']} r_attn={st['r_attn']} r_mlp={st['r_mlp']}  B={st['micro_batch_size']} "
      f"S={st['seq_length']} ({st['tokens']} tokens)  {st['dtype']} "
      f"({st['element_size']} B/elem)  TP={st['tp']}\n")
    _print_rows(report, w)
    _print_measured_and_anchor(report, w)
