"""Pre-emption: SIGTERM / SIGUSR1 / SIGINT (Ctrl-C) set a flag; each step's one all-reduce makes
every rank agree on it, and the loop stops at that step's boundary. A second SIGINT stops the
process at once, without saving (one line from rank 0, exit status 130 = 128 + SIGINT): the
user who presses Ctrl-C twice wants out now; the last complete checkpoint stays in force.
Only SIGINT escalates: Slurm sends SIGUSR1 ahead of its SIGTERM, and neither may cut a save.

Under ``torchrun`` alone, Ctrl-C reaches torchrun only (each rank leads its own session);
torchrun forwards it once and exits 1 with its ``SignalException``. The project's launcher
(``cli/launch.py``) instead forwards the signal to the ranks itself and exits with their
status, 0 after a saved stop.

Under Slurm, torchrun handles the same signal (``PET_SIGNALS_TO_HANDLE`` in
``scripts/slurm/pretrain.sbatch``) and itself exits non-zero after its ranks have finished,
which is what makes the batch script requeue the job.
"""

from __future__ import annotations

import os
import signal
import sys

__all__ = ["PREEMPT_EXIT_CODE", "INTERRUPT_EXIT_CODE", "PREEMPTION_SIGNALS",
           "install_signal_handlers", "restore_signal_handlers", "preemption_requested",
           "signal_name", "interrupted_line"]

#: Exit status after a pre-emption signal was handled and the checkpoint is complete.
PREEMPT_EXIT_CODE = 0
#: Exit status after a second Ctrl-C stopped the process at once (the shell's 128 + SIGINT).
INTERRUPT_EXIT_CODE = 128 + signal.SIGINT

#: The signals that ask for a save at the next step boundary.
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)

_received: dict = {"signum": None}


def interrupted_line() -> str:
    """The one line a second Ctrl-C ends with (printed by rank 0, or by the launcher)."""
    return ("error: interrupted again: stopped at once without saving; the same command "
            "resumes from the last complete checkpoint")


def _on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
    if signum == signal.SIGINT and _received["signum"] == signal.SIGINT:
        if int(os.environ.get("RANK", "0")) == 0:
            print(interrupted_line(), file=sys.stderr, flush=True)
        os._exit(INTERRUPT_EXIT_CODE)  # at once: no collective, no save, no clean-up to wait on
    _received["signum"] = signum


def install_signal_handlers() -> dict:
    """Catch the pre-emption signals for this run (a signal left from an earlier run in the
    same process is forgotten); returns the handlers they replace, for
    :func:`restore_signal_handlers` when the run ends."""
    _received["signum"] = None
    return {sig: signal.signal(sig, _on_signal) for sig in PREEMPTION_SIGNALS}


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
