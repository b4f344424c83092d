"""Pre-emption: SIGTERM / SIGUSR1 set a flag; each step's one all-reduce makes every rank agree on
it, and the loop stops at that step's boundary.

Under Slurm, torchrun handles the same signal (``PET_SIGNALS_TO_HANDLE`` in
``scripts/slurm/pretrain.sbatch``) and itself exits non-zero after its ranks have finished,
which is what makes the batch script requeue the job.
"""

from __future__ import annotations

import signal

__all__ = ["PREEMPT_EXIT_CODE", "install_signal_handlers", "restore_signal_handlers",
           "preemption_requested", "signal_name"]

#: Exit status after a pre-emption signal was handled and the checkpoint is complete.
PREEMPT_EXIT_CODE = 0

_received: dict = {"signum": None}


def _on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
    _received["signum"] = signum


_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def install_signal_handlers() -> dict:
    """Catch the pre-emption signals for this run; returns the handlers they replace, for
    :func:`restore_signal_handlers` when the run ends."""
    return {sig: signal.signal(sig, _on_signal) for sig in _SIGNALS}


def restore_signal_handlers(previous: dict) -> None:
    """Put back the handlers :func:`install_signal_handlers` replaced (a run started by
    ``main(argv)`` in a process that goes on leaves it as it found it)."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def preemption_requested() -> bool:
    """Whether this rank has received a pre-emption signal. The ranks agree on it through the
    step's one all-reduce (``train/resilience.py``, :func:`agree_on_step`)."""
    return _received["signum"] is not None


def signal_name() -> str:
    """The signal this rank received, or a note that another rank received it."""
    signum = _received["signum"]
    return signal.Signals(signum).name if signum else "signal on another rank"
