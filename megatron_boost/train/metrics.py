"""What a run reports: the log-window accumulator, the console lines, metrics.jsonl,
TensorBoard and Weights & Biases.

``metrics.jsonl`` has one JSON object per logged iteration: ``iteration``, ``tokens``
(consumed), ``loss`` (mean training loss over the log window), ``lr``, ``grad_norm``,
``tokens_per_s``, ``tflops`` (achieved model TFLOP/s per device, ``analysis/flops.py``),
``mfu`` (null without a known peak), ``tp_comm_bytes`` (bytes this rank hands to tensor-parallel
collectives per step, forward and backward, from the formula; docs/design.md §5; with
``logging.measure_comm`` also ``tp_comm_bytes_measured``, recorded around that step),
``peak_mem_bytes``,
``step_time_s``, ``skipped_steps`` (non-finite steps skipped in the window), ``elapsed_s``
(wall time since this launch's training loop started) and ``eta_s`` (the estimated time to
the end of the budget, :class:`Progress`); evaluations add ``val_loss`` and ``val_ppl``. Global rank 0 writes it; on resume the records after the
resumed iteration are dropped, so the file is one trajectory. TensorBoard and W&B get the same
numeric fields as scalars at step ``iteration``; W&B also the resolved configuration.
"""

from __future__ import annotations

import json
import math
import resource
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["LogWindow", "MetricsWriter", "WandbRun", "Progress", "peak_memory_bytes", "format_log_line",
           "format_validation_line", "validation_perplexity", "format_duration"]


@dataclass
class LogWindow:
    """Sums over the steps since the last log line (one reset)."""

    loss_sum: float = 0.0
    loss_count: int = 0
    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0
    skipped: int = 0

    def add(self, loss: Optional[float], seconds: float, tokens: int,
            skipped: bool = False) -> None:
        """One step; ``loss`` may be None (no rank reported one). A skipped (non-finite) step
        is counted, its loss is left out of the mean."""
        self.seconds += seconds
        self.tokens += tokens
        self.steps += 1
        self.skipped += int(skipped)
        if loss is not None and not skipped:
            self.loss_sum += loss
            self.loss_count += 1

    def mean_loss(self) -> Optional[float]:
        return self.loss_sum / self.loss_count if self.loss_count else None

    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def step_time_s(self) -> float:
        return self.seconds / max(1, self.steps)

    def reset(self) -> None:
        self.__init__()


@dataclass
class Progress:
    """Elapsed time and ETA of this launch. The ETA extrapolates the mean measured since the
    loop started (so saves and evaluations are in it, as they will be in the rest of the run):
    the remaining iterations times the mean step time, or, when a token budget sets the
    run's length (``training.train_tokens``), the remaining tokens over the mean token rate."""

    start_s: float  # time.perf_counter() when the loop started
    start_iteration: int
    start_tokens: int
    train_iters: int
    train_tokens: Optional[int] = None  # the budget when it is given in tokens

    def elapsed_s(self, now: float) -> float:
        return now - self.start_s

    def eta_s(self, now: float, iteration: int, tokens: int) -> Optional[float]:
        """Seconds to the end of the budget; None before a step of this launch was measured."""
        elapsed = self.elapsed_s(now)
        if self.train_tokens is not None:
            done, remaining = tokens - self.start_tokens, max(0, self.train_tokens - tokens)
        else:
            done, remaining = iteration - self.start_iteration, self.train_iters - iteration
        return remaining * elapsed / done if done > 0 and elapsed > 0 else None

    def done_line(self, now: float, launch_s: float, iteration: int, tokens: int) -> str:
        """The ``done:`` line's figures: this launch's iterations, tokens and time (``launch_s``
        since the process started, the training loop's since it began); after a resume the
        run's totals apart, so a relaunch is not credited with the iterations before it."""
        timing = (f"in {launch_s:.1f}s ({format_duration(launch_s)}, training loop "
                  f"{format_duration(self.elapsed_s(now))})")
        if self.start_iteration == 0:
            return f"done: {iteration} iterations, {tokens:,} tokens {timing}"
        return (f"done: {iteration - self.start_iteration} iterations this launch "
                f"({self.start_iteration} -> {iteration}), {tokens - self.start_tokens:,} tokens "
                f"{timing}; run total {iteration} iterations, {tokens:,} tokens")


def format_duration(seconds: Optional[float]) -> str:
    """``45s``, ``12m05s``, ``3h07m``, ``2d04h``: the precision a person reads at a glance."""
    if seconds is None:
        return "n/a"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def validation_perplexity(val_loss: Optional[float]) -> Optional[float]:
    return math.exp(min(val_loss, 700.0)) if val_loss is not None else None  # no overflow


def peak_memory_bytes(device: str) -> int:
    if device == "cuda":
        return int(torch.cuda.max_memory_allocated())
    # Linux reports ru_maxrss in KiB (macOS in bytes).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _fmt_bytes(n: float) -> str:
    """Binary units (powers of 1024), so labelled KiB, MiB, GiB, TiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def format_log_line(record: dict, train_iters: int) -> str:
    """The console line of a metrics record."""
    mfu = "n/a" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%"
    return (f"iter {record['iteration']:>6}/{train_iters} | tokens {record['tokens']:>12,} | "
            f"loss {_fmt(record['loss'], '.4f')} | lr {record['lr']:.3e} | grad_norm "
            f"{_fmt(record['grad_norm'], '.3f')} | {record['tokens_per_s']:,.0f} tok/s | "
            f"{record['tflops']:.3g} TFLOP/s/dev | MFU {mfu} | "
            f"tp_comm {_fmt_bytes(record['tp_comm_bytes'])}/step | peak mem "
            f"{_fmt_bytes(record['peak_mem_bytes'])} | elapsed "
            f"{format_duration(record['elapsed_s'])} | ETA {format_duration(record['eta_s'])}")


def format_validation_line(record: dict, seconds: float) -> str:
    return (f"  validation @ {record['iteration']}: val_loss {_fmt(record['val_loss'], '.4f')} "
            f"| val_ppl {_fmt(record['val_ppl'], '.2f')} ({seconds:.1f}s)")


class MetricsWriter:
    """metrics.jsonl (+ optional TensorBoard and W&B) on global rank 0. ``wandb``: the run's
    ``logging.wandb`` section and its resolved configuration (a dict), or None."""

    def __init__(self, run_dir: Path, tensorboard: bool, resume_iteration: int,
                 wandb=None):
        self.enabled = not dist.is_initialized() or dist.get_rank() == 0
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        self.wandb = None
        if not self.enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self._truncate_after(resume_iteration)
        if tensorboard:
            self.tb = _summary_writer(run_dir / "tensorboard")
        if wandb is not None and wandb[0].project is not None:
            self.wandb = WandbRun(wandb[0], wandb[1], run_dir, resume_iteration)

    def _truncate_after(self, iteration: int) -> None:
        """Keep only what precedes the resumed iteration: one trajectory per file."""
        kept = []
        for line in self.path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("iteration", 0) <= iteration:
                kept.append(line)
        self.path.write_text("".join(k + "\n" for k in kept))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        scalars = _scalars(record)
        if self.tb is not None:
            for key, value in scalars.items():
                self.tb.add_scalar(key, value, record["iteration"])
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, record["iteration"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None


def _scalars(record: dict) -> dict:
    """The numeric fields of a metrics record but its iteration (the step they are logged at)."""
    return {key: value for key, value in record.items()
            if key != "iteration" and isinstance(value, (int, float))
            and not isinstance(value, bool)}


#: The file in the run directory that keeps the W&B run id, so a resume continues that run.
WANDB_ID_FILE = "wandb_run_id"


class WandbRun:
    """One W&B run for a training run, continued across resumes: a fresh start (iteration 0)
    makes a new run id and keeps it in ``<run_dir>/wandb_run_id``; a resume reads it back and
    continues that run (``resume="allow"``). Records re-logged after a resume went back to
    an earlier checkpoint are at steps W&B has already seen: online, W&B keeps the first.
    wandb's own console output is off (one line here says where the run goes); its
    background service is shut down on close."""

    def __init__(self, cfg, config: dict, run_dir: Path, resume_iteration: int):
        import wandb

        id_file = run_dir / WANDB_ID_FILE
        if resume_iteration > 0 and id_file.exists():
            run_id = id_file.read_text().strip()
        else:
            import secrets

            run_id = secrets.token_hex(4)  # W&B's own ids are 8 characters too
            id_file.write_text(run_id + "\n")
        files = Path(cfg.dir or run_dir)
        files.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=cfg.project, name=cfg.name or run_dir.resolve().name,
                              dir=str(files), mode=cfg.mode, id=run_id, resume="allow",
                              config=config,
                              settings=wandb.Settings(silent=True, console="off"))
        print(f"W&B: run {run_id} of project {cfg.project} ({cfg.mode}; files under "
              f"{files / 'wandb'})", flush=True)

    def log(self, scalars: dict, iteration: int) -> None:
        self.run.log(scalars, step=iteration)

    def close(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()  # stops wandb's background service: nothing outlives the run


def _summary_writer(log_dir: Path):
    """A TensorBoard SummaryWriter, or None when the optional tensorboard package is absent."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("notice: tensorboard is not installed; skipping TensorBoard logging "
              "(pip install tensorboard, or set logging.tensorboard=false)", flush=True)
        return None
    return SummaryWriter(log_dir=str(log_dir))
