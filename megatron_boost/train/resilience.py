"""Faults during training: non-finite steps and unresponsive ranks.

The fault-tolerance tests inject the faults from outside, through the trainer's callbacks
(``megatron_boost/testing/faults.py``, ``train/callbacks.py``).

* Non-finite steps: :func:`agree_on_step` is the step's one all-reduce over the world and its
  one host read; it carries "this rank's loss and gradients are not finite", "this rank
  received a pre-emption signal", "this rank's clock passed ``training.exit_duration_minutes``"
  and the loss, so a step any rank flags is skipped by every
  rank (no optimizer step: parameters, Adam moments and step counts are untouched). The iteration and
  the data position still advance (the batch is consumed, the LR schedule is a function of
  the iteration). :class:`SkipBudget` stops the run at the ``training.max_skipped_steps``-th
  consecutive skip with :class:`TrainingDiverged`, naming the iteration.
* Unresponsive ranks: the process groups are created with ``parallel.timeout_minutes``; when a
  collective times out, :class:`RankMonitor` runs ``torch.distributed.monitored_barrier`` on a
  separate gloo group of its own (the default group may be unusable after the timeout), which
  reports the ranks that never arrived, and raises :class:`RankTimeout` naming them.
* The same on NCCL: there a collective that waits for a dead or hung peer blocks the host in
  its next device read, and NCCL's watchdog aborts the process at the group's timeout
  (``TORCH_NCCL_ASYNC_ERROR_HANDLING``'s default), so no error reaches the trainer.
  :class:`StallWatch`, a thread, asks the same gloo group who is missing once the training
  step has run ``parallel.timeout_minutes``, and the NCCL groups get a longer timeout
  (:func:`collective_timeout`), so that it reports first (docs/fault-tolerance.md).
"""

from __future__ import annotations

import contextlib
import datetime
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

__all__ = ["StepAgreement", "agree_on_step", "SkipBudget", "TrainingDiverged", "RankMonitor",
           "RankTimeout", "process_group_timeout", "is_collective_failure", "StallWatch",
           "collective_timeout", "stall_barrier_window"]


class TrainingDiverged(RuntimeError):
    """Too many consecutive non-finite steps."""


class RankTimeout(RuntimeError):
    """A collective timed out because some rank stopped responding."""


def process_group_timeout(minutes: float) -> datetime.timedelta:
    """``parallel.timeout_minutes`` as the timedelta ``init_process_group`` takes."""
    return datetime.timedelta(seconds=minutes * 60.0)


#: The longest :class:`StallWatch`'s barrier waits for the other stalled ranks to join it.
STALL_BARRIER_MAX = datetime.timedelta(seconds=60)
#: Time left after that barrier, before NCCL's watchdog would abort, to print and exit.
STALL_REPORT_MARGIN = datetime.timedelta(seconds=60)


def stall_barrier_window(minutes: float) -> datetime.timedelta:
    """How long the stall watch's barrier waits: the ranks' steps start within a fraction of a
    step of each other, so a minute at most (the deadline itself when that is shorter)."""
    return min(process_group_timeout(minutes), STALL_BARRIER_MAX)


def collective_timeout(minutes: float, device: str) -> datetime.timedelta:
    """The timeout of the run's process groups. On CPU (gloo) ``parallel.timeout_minutes``: a
    collective that times out raises, and :class:`RankMonitor` explains it. On CUDA (NCCL) the
    watchdog aborts the process at the timeout instead, so it is the deadline of
    :class:`StallWatch`, plus its barrier window, plus time to report: the watch names the
    missing rank and ends the job first; the watchdog stays the backstop."""
    deadline = process_group_timeout(minutes)
    if device != "cuda":
        return deadline
    return deadline + stall_barrier_window(minutes) + STALL_REPORT_MARGIN


# ---------------------------------------------------------------------------------------------
# non-finite steps
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepAgreement:
    """What every rank agrees on after a step's forward and backward passes."""

    finite: bool
    """Every rank's losses (and gradients, where checked) are finite."""
    preempt: bool
    """Some rank received a pre-emption signal."""
    time_up: bool
    """Some rank's elapsed time passed ``training.exit_duration_minutes``."""
    loss: Optional[float]
    """Mean loss over the global batch; None where no rank reported one."""


def agree_on_step(losses: List, grad_buffers: List, preempt_requested: bool,
                  loss_reporter: bool, device, time_up: bool = False) -> StepAgreement:
    """ONE all-reduce (SUM over the world) and ONE host read for the step: this rank's
    non-finite flag (its micro-batch ``losses`` and ``grad_buffers``), its pre-emption flag,
    its time-limit flag (``time_up``: each rank reads its own clock, so ranks may disagree by
    a few milliseconds; the sum makes the first one that passes decide for all, at the same
    step boundary, so no rank is left waiting in a collective), and, where ``loss_reporter`` (one rank per data-parallel replica: last pipeline stage, TP
    rank 0), its mean micro-batch loss with a count of one. Flags are small integers in fp32,
    exact; the loss is the replicas' sum divided by their count."""
    import torch
    import torch.distributed as dist

    nonfinite = torch.zeros((), dtype=torch.float32, device=device)
    for t in list(losses) + list(grad_buffers):
        nonfinite = torch.maximum(nonfinite, (~torch.isfinite(t).all()).to(nonfinite))
    report = loss_reporter and len(losses) > 0
    loss = torch.stack(list(losses)).float().mean().to(device) if report else nonfinite.new_zeros(())
    flags = torch.stack([nonfinite, nonfinite.new_tensor(float(preempt_requested)), loss,
                         nonfinite.new_tensor(float(report)),
                         nonfinite.new_tensor(float(time_up))])  # [5]
    dist.all_reduce(flags)
    bad, preempt, loss_sum, reporters, late = flags.tolist()
    return StepAgreement(finite=bad == 0, preempt=preempt > 0, time_up=late > 0,
                         loss=loss_sum / reporters if reporters else None)


class SkipBudget:
    """Counts consecutive skipped steps; the ``limit``-th raises :class:`TrainingDiverged`."""

    def __init__(self, limit: int):
        self.limit, self.consecutive = limit, 0

    def record(self, skipped: bool, iteration: int) -> None:
        self.consecutive = self.consecutive + 1 if skipped else 0
        if skipped and self.consecutive >= self.limit:
            raise TrainingDiverged(
                f"{self.consecutive} consecutive non-finite steps, the last at iteration "
                f"{iteration} (training.max_skipped_steps={self.limit}); stopped without "
                f"saving; resume from the last checkpoint with a lower optimizer.lr")


# ---------------------------------------------------------------------------------------------
# unresponsive ranks
# ---------------------------------------------------------------------------------------------

_MISSING_RANKS = re.compile(r"[Rr]anks? ([\d, ]+) failed to pass monitoredBarrier")


def is_collective_failure(err: RuntimeError) -> bool:
    """Whether ``err`` is a collective that failed (timed out, or lost its peer)."""
    import torch.distributed as dist

    return isinstance(err, dist.DistError) or "timed out" in str(err).lower()


class RankMonitor:
    """A gloo group of all ranks, used only to find out who stopped responding."""

    def __init__(self, timeout: datetime.timedelta):
        import torch.distributed as dist

        self.timeout = timeout
        self.group = dist.new_group(backend="gloo", timeout=timeout)

    def unresponsive_ranks(self) -> List[int]:
        """Ranks that do not reach a monitored barrier within the timeout (rank 0 asks)."""
        return self.barrier(self.timeout) or []

    def barrier(self, timeout: datetime.timedelta) -> Optional[List[int]]:
        """A monitored barrier: [] when every rank reached it within ``timeout``, the ranks
        that did not where it names them (on rank 0), None where it failed otherwise."""
        import torch.distributed as dist

        try:
            dist.monitored_barrier(group=self.group, timeout=timeout, wait_all_ranks=True)
        except RuntimeError as err:
            match = _MISSING_RANKS.search(str(err))
            if match:
                return [int(r) for r in match.group(1).replace(" ", "").split(",") if r]
            return None
        return []

    def explain(self, err: RuntimeError, iteration: int) -> RankTimeout:
        """The :class:`RankTimeout` for a collective that failed at ``iteration``."""
        ranks = self.unresponsive_ranks()
        minutes = self.timeout.total_seconds() / 60
        who = f"rank {', '.join(map(str, ranks))}" if ranks else "another rank"
        return RankTimeout(
            f"{who} did not respond within {minutes:g} minutes (parallel.timeout_minutes) at "
            f"iteration {iteration}; the job stops ({' '.join(str(err).split())[:120]})")


class StallWatch:
    """Names a dead or hung rank where a timed-out collective raises nothing (NCCL).

    The trainer runs each training step inside :meth:`step`. A thread checks every
    ``poll_s``; once this rank's step has run ``deadline``, it joins :class:`RankMonitor`'s
    monitored barrier (gloo, ``barrier_window``). Every rank whose step is stuck waiting for a
    missing peer joins; a dead rank, or one stuck outside its step, does not, and rank 0's
    barrier names it. ``on_stall`` then gets the :class:`RankTimeout` (the trainer prints it
    and ends the process: the main thread is blocked in the device read and cannot be
    interrupted). A rank stuck inside its step like the others, or rank 0 itself, is not
    named: the error says "another rank", or that every rank is inside the step."""

    def __init__(self, monitor: RankMonitor, deadline: datetime.timedelta,
                 barrier_window: datetime.timedelta,
                 on_stall: Callable[[RankTimeout], None], poll_s: float = 1.0):
        self.monitor, self.on_stall = monitor, on_stall
        self.deadline_s = deadline.total_seconds()
        self.barrier_window = barrier_window
        self.poll_s = min(poll_s, self.deadline_s / 4)
        self._step: Optional[Tuple[int, float]] = None  # (iteration, start)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)

    def start(self) -> "StallWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    @contextlib.contextmanager
    def step(self, iteration: int):
        """The training step of ``iteration`` (its collectives and device reads)."""
        self._step = (iteration, time.monotonic())
        try:
            yield
        finally:
            self._step = None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            current = self._step
            if current is None or time.monotonic() - current[1] < self.deadline_s:
                continue
            self.on_stall(self._explain(current[0]))
            return

    def _explain(self, iteration: int) -> RankTimeout:
        ranks = self.monitor.barrier(self.barrier_window)
        minutes = self.deadline_s / 60
        if ranks:
            who = f"rank {', '.join(map(str, ranks))} did not respond"
        elif ranks is None:
            who = "another rank did not respond"
        else:
            who = ("every rank is inside the step, which did not finish (a device, NCCL or "
                   "host stall in it)")
        return RankTimeout(f"{who} within {minutes:g} minutes (parallel.timeout_minutes) at "
                           f"iteration {iteration}; the job stops")
