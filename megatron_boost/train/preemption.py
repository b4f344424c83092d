"""Pre-emption: SIGTERM / SIGUSR1 set a flag; at each step boundary all ranks agree on it.

Under Slurm, torchrun handles the same signal (``PET_SIGNALS_TO_HANDLE`` in
``scripts/slurm/pretrain.sbatch``) and itself exits non-zero after its ranks have finished,
which is what makes the batch script requeue the job.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

__all__ = ["PREEMPT_EXIT_CODE", "install_signal_handlers", "preemption_agreed", "signal_name"]

#: Exit status after a pre-emption signal was handled and the checkpoint is complete.
PREEMPT_EXIT_CODE = 0

_received: dict = {"signum": None}


def _on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
    _received["signum"] = signum


def install_signal_handlers() -> None:
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, _on_signal)


def preemption_agreed(device) -> bool:
    """Whether any rank has received a pre-emption signal (one all-reduce over the world)."""
    flag = torch.tensor([0 if _received["signum"] is None else 1], dtype=torch.int32,
                        device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def signal_name() -> str:
    """The signal this rank received, or a note that another rank received it."""
    signum = _received["signum"]
    return signal.Signals(signum).name if signum else "signal on another rank"
