"""What a checkpoint costs at size: save and resume times per rank, with and without the
integrity checks of ``train/checkpoint_guard.py`` (fsync + CRC-32 of the rank's own shard
files at save, their CRC-32 at resume), at the shard sizes one rank of a shipped configuration
writes, and whether a save fits the pre-emption window.

One rank's shard, per parameter it holds (parameters / (tp · pp)): the bf16 weights (2 bytes)
and, with the distributed optimizer sharded over no data-parallel peer (the largest case),
fp32 main weights and Adam's two moments (12 bytes). Synthetic tensors of that size are
written as files of ``--file-mib`` each (torch_dist writes one or a few large files per
rank), so the figures are the file system's and the CRC's, not the model's. Reads right after
the writes may come from the page cache: resume figures are lower bounds.

    python tools/checkpoint_cost.py                       # cola-1b and cola-7b, 1/8 of size
    python tools/checkpoint_cost.py --scale 1 --dir /shared/scratch   # full size, there
    python tools/checkpoint_cost.py --estimate CONFIG [section.key=value ...]

``--estimate`` measures nothing: it divides one rank's shard by a write rate (``--write-mib-s``,
default :data:`DEFAULT_WRITE_MIB_S`) and proposes the lead time of Slurm's pre-emption signal
that leaves the save time to finish; ``scripts/slurm/submit.sh`` uses it.

With ``--scale`` below 1 a fraction of each shard is measured and every time is scaled to the
full size (linear: the work is I/O and a CRC over every byte).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Sequence

from megatron_boost.cli.errors import one_line_errors

__all__ = ["main", "shard_bytes_per_rank", "shard_bytes", "measure", "save_estimate",
           "signal_lead_seconds", "DEFAULT_WRITE_MIB_S", "DEFAULT_LEAD_S"]

#: bf16 weights + fp32 main weights + Adam's exp_avg and exp_avg_sq.
BYTES_PER_PARAM = 2 + 4 + 4 + 4
MIB = 1 << 20
#: The write rate (MiB/s per rank, fsync and CRC-32 included) a save is estimated at when the
#: file system's own is not given: the slower of the two this tool measured on the project's
#: machine (docs/fault-tolerance.md: cola-1b's 7.9 GiB shard in 250.7 s), a slow disk, so that
#: an estimate errs long. Measure the cluster's with this tool and pass it.
DEFAULT_WRITE_MIB_S = 32.0
#: pretrain.sbatch's own lead time (#SBATCH --signal=B:USR1@180), the least proposed.
DEFAULT_LEAD_S = 180


def shard_bytes_per_rank(config_path: str) -> Dict[str, int]:
    """{'params', 'bytes', 'tp', 'pp'} of one rank's checkpoint shard for a configuration."""
    from megatron_boost.config.run import load_run_config

    return shard_bytes(load_run_config(config_path))


def shard_bytes(cfg) -> Dict[str, int]:
    """:func:`shard_bytes_per_rank` of a loaded run configuration."""
    from megatron_boost.config.shape import ModelShape
    from megatron_boost.config.modes import TPMode

    shape = ModelShape.from_config(cfg)
    lowrank = TPMode.parse(cfg.parallel.mode).is_lowrank
    params = shape.num_layers * shape.layer_params(lowrank) + shape.embedding_params()
    ranks = cfg.parallel.tp * cfg.parallel.pp
    per_rank = params // ranks
    return {"params": per_rank, "bytes": per_rank * BYTES_PER_PARAM, "tp": cfg.parallel.tp,
            "pp": cfg.parallel.pp}


def save_estimate(cfg, write_mib_s: float = DEFAULT_WRITE_MIB_S) -> Dict[str, float]:
    """{'save_s', 'gib', 'lead_s'}: one rank's shard written at ``write_mib_s``, and the signal
    lead time :func:`signal_lead_seconds` proposes for it."""
    if not write_mib_s > 0:
        raise ValueError(f"--write-mib-s ({write_mib_s}) must be a positive rate in MiB/s; "
                         f"measure it with tools/checkpoint_cost.py --dir <checkpoint fs>")
    nbytes = shard_bytes(cfg)["bytes"]
    save_s = nbytes / (write_mib_s * MIB)
    return {"save_s": save_s, "gib": nbytes / 2**30, "lead_s": signal_lead_seconds(save_s)}


def signal_lead_seconds(save_s: float) -> int:
    """The pre-emption signal's lead: the estimated save and a quarter more (the step in flight,
    the commit), rounded up to half a minute, at least :data:`DEFAULT_LEAD_S`."""
    return max(DEFAULT_LEAD_S, 30 * math.ceil(1.25 * save_s / 30))


def _random_block(file_bytes: int) -> memoryview:
    import torch

    return memoryview(torch.randn(file_bytes // 4).numpy().tobytes())


def _write_shards(ckpt: Path, nbytes: int, block: memoryview) -> None:
    ckpt.mkdir(parents=True)
    written, index = 0, 0
    while written < nbytes:
        n = min(len(block), nbytes - written)
        with open(ckpt / f"__0_{index}.distcp", "wb") as f:
            f.write(block[:n])
        written, index = written + n, index + 1


def _read_shards(ckpt: Path) -> int:
    total = 0
    for path in sorted(ckpt.glob("*.distcp")):
        total += len(path.read_bytes())
    return total


def measure(nbytes: int, file_bytes: int, work_dir: Path) -> Dict[str, float]:
    """Seconds for one rank's shard of ``nbytes``: save, its integrity work (fsync + CRC and
    the manifest), resume's read and its CRC check."""
    from megatron_boost.train.checkpoint_guard import (
        shard_entries,
        verify_manifest,
        write_manifest,
    )

    ckpt = work_dir / "iter_0000001"
    block = _random_block(file_bytes)  # the tensors' bytes, made before the clock starts
    t0 = time.perf_counter()
    _write_shards(ckpt, nbytes, block)
    t1 = time.perf_counter()
    write_manifest(ckpt, shard_entries(ckpt))  # fsync + CRC-32 of this rank's files
    t2 = time.perf_counter()
    _read_shards(ckpt)
    t3 = time.perf_counter()
    verify_manifest(ckpt)
    t4 = time.perf_counter()
    shutil.rmtree(ckpt)
    return {"save_s": t1 - t0, "save_integrity_s": t2 - t1, "load_s": t3 - t2,
            "load_integrity_s": t4 - t3}


def format_row(name: str, shard: Dict[str, int], t: Dict[str, float], window_s: float) -> str:
    saved = t["save_s"] + t["save_integrity_s"]
    fits = "fits" if saved <= window_s else "DOES NOT FIT"
    return (f"{name:<8} tp={shard['tp']} pp={shard['pp']} {shard['params'] / 1e9:6.2f}B params "
            f"{shard['bytes'] / 2**30:6.1f} GiB | save {t['save_s']:7.1f} s + integrity "
            f"{t['save_integrity_s']:6.1f} s | resume {t['load_s']:7.1f} s + integrity "
            f"{t['load_integrity_s']:6.1f} s | save with integrity {saved:7.1f} s: {fits} in "
            f"the {window_s:g} s pre-emption window")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="checkpoint_cost.py", description=__doc__.split("\n\n")[0],
        epilog="checkpoint_cost.py --estimate CONFIG [section.key=value ...] [--write-mib-s R]: "
               "measures nothing; one rank's shard at R MiB/s (default "
               f"{DEFAULT_WRITE_MIB_S:g}) and the pre-emption signal's lead time for it")
    ap.add_argument("--configs", nargs="+", default=["configs/cola-1b.yaml",
                                                     "configs/cola-7b.yaml"])
    ap.add_argument("--scale", type=float, default=0.125,
                    help="fraction of each shard measured, times scaled to the full size")
    ap.add_argument("--file-mib", type=int, default=1024, help="size of each shard file")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp directory)")
    ap.add_argument("--window", type=float, default=180.0,
                    help="pre-emption window, seconds (#SBATCH --signal=B:USR1@180)")
    return ap


def estimate_main(argv: Sequence[str]) -> int:
    """``--estimate CONFIG [overrides] [--write-mib-s R]``: one line, ``estimated save S s
    (G GiB per rank at R MiB/s): signal lead time L s``."""
    from megatron_boost.config.run import load_run_config

    ap = argparse.ArgumentParser(prog="checkpoint_cost.py --estimate")
    ap.add_argument("config")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--write-mib-s", type=float, default=DEFAULT_WRITE_MIB_S,
                    help="one rank's write rate to the checkpoint file system, MiB/s")
    args = ap.parse_args(argv)
    est = save_estimate(load_run_config(args.config, args.overrides), args.write_mib_s)
    print(f"estimated save {math.ceil(est['save_s'])} s ({est['gib']:.1f} GiB per rank at "
          f"{args.write_mib_s:g} MiB/s): signal lead time {est['lead_s']} s")
    return 0


@one_line_errors
def main(argv: Sequence[str] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--estimate"]:
        return estimate_main(argv[1:])
    args = build_parser().parse_args(argv)
    if not 0 < args.scale <= 1:
        raise ValueError(f"--scale ({args.scale}) must be in (0, 1]")
    base = Path(args.dir) if args.dir else None
    work = Path(tempfile.mkdtemp(prefix="ckpt-cost-", dir=base))
    try:
        print(f"checkpoint cost per rank (bytes/param {BYTES_PER_PARAM}: bf16 weights + fp32 "
              f"main weights + Adam moments; measured at {args.scale:g} of each shard in "
              f"{args.file_mib} MiB files and scaled; {os.cpu_count()} CPUs)")
        for path in args.configs:
            shard = shard_bytes_per_rank(path)
            nbytes = max(int(shard["bytes"] * args.scale), MIB)
            t = measure(nbytes, args.file_mib * MIB, work)
            t = {k: v * shard["bytes"] / nbytes for k, v in t.items()}
            print(format_row(Path(path).stem, shard, t, args.window))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0
