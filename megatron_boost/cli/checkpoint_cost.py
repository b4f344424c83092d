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

With ``--scale`` below 1 a fraction of each shard is measured and every time is scaled to the
full size (linear: the work is I/O and a CRC over every byte).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Dict, Sequence

from megatron_boost.cli.errors import one_line_errors

__all__ = ["main", "shard_bytes_per_rank", "measure"]

#: bf16 weights + fp32 main weights + Adam's exp_avg and exp_avg_sq.
BYTES_PER_PARAM = 2 + 4 + 4 + 4
MIB = 1 << 20


def shard_bytes_per_rank(config_path: str) -> Dict[str, int]:
    """{'params', 'bytes', 'tp', 'pp'} of one rank's checkpoint shard for a configuration."""
    from megatron_boost.analysis.shape import ModelShape
    from megatron_boost.config.run import load_run_config

    cfg = load_run_config(config_path)
    shape = ModelShape.from_config(cfg)
    lowrank = cfg.parallel.mode != "full"
    params = shape.num_layers * shape.layer_params(lowrank) + shape.embedding_params()
    ranks = cfg.parallel.tp * cfg.parallel.pp
    per_rank = params // ranks
    return {"params": per_rank, "bytes": per_rank * BYTES_PER_PARAM, "tp": cfg.parallel.tp,
            "pp": cfg.parallel.pp}


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
    ap = argparse.ArgumentParser(prog="checkpoint_cost.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", default=["configs/cola-1b.yaml",
                                                     "configs/cola-7b.yaml"])
    ap.add_argument("--scale", type=float, default=0.125,
                    help="fraction of each shard measured, times scaled to the full size")
    ap.add_argument("--file-mib", type=int, default=1024, help="size of each shard file")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp directory)")
    ap.add_argument("--window", type=float, default=180.0,
                    help="pre-emption window, seconds (#SBATCH --signal=B:USR1@180)")
    return ap


@one_line_errors
def main(argv: Sequence[str] = None) -> int:
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
