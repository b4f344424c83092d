"""Nothing a rank starts outlives it (docs/design.md §10.4).

megatron's dist_checkpointing starts a helper process with the ``spawn`` start method on the
first checkpoint save, sync or async: ``FileSystemWriterAsync`` keeps a
``multiprocessing.Manager()`` (a server process) for its write results for the rest of the
process's life, and the async writer keeps a spawned worker. Both exit cleanly when the rank
exits, but after a SIGKILL of the rank (an OOM kill, a node agent, ``kill -9``) nobody tells
them: they wait on a futex forever, each holding a copy of the imported libraries.

A spawned child re-imports the parent's main module (``pretrain_lowrank.py`` and every tool
import this package there), so the package's ``__init__`` calls :func:`exit_with_parent` in
every such child: Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` makes the kernel kill the child
when its parent dies. The signal follows the parent *thread* that started the child; megatron
starts these helpers from the training thread, which lives as long as the rank.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["is_spawned_child", "exit_with_parent"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def is_spawned_child(argv=None) -> bool:
    """Whether this process is a ``multiprocessing`` spawn child: its interpreter command line
    (``sys.orig_argv``; ``sys.argv`` is replaced by the parent's while the child imports the
    main module) ends with ``--multiprocessing-fork``, as ``multiprocessing.spawn`` writes it."""
    return "--multiprocessing-fork" in (sys.orig_argv if argv is None else argv)


def exit_with_parent() -> bool:
    """In a spawn child on Linux: have the kernel SIGKILL this process when its parent dies.
    Returns whether the request was made."""
    if not sys.platform.startswith("linux") or not is_spawned_child():
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # the parent died before the request: it would never fire
        os._exit(1)
    return True
