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

An asynchronous save also *forks*: megatron's ``TemporalAsyncCaller`` forks a process per save
that runs ``FileSystemWriterAsync.write_preloaded_data_multiproc``, which forks one writer per
bucket (``write_preloaded_data``). A forked child imports nothing, so the import-time guard
above never runs in it; after a SIGKILL of the rank such a writer was seen alive minutes later,
orphaned, ignoring SIGTERM. :func:`forked_children_die_with_parent`, called by the trainer at
start, installs an ``os.register_at_fork`` hook (inherited by every forked child, so it covers
the writers the forked caller forks in turn) that makes the kernel SIGKILL each child forked
from a process's main thread when that process dies. A fork from another thread is left alone:
the signal would follow that thread, which may end long before the process (a thread pool's).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

__all__ = ["is_spawned_child", "exit_with_parent", "forked_children_die_with_parent"]

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
    return _die_with(os.getppid())


def _die_with(parent: int) -> bool:
    """Ask the kernel to SIGKILL this process when its parent (pid ``parent``) dies; exit at
    once if it already has (the request would never fire)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:
        os._exit(1)
    return True


#: Thread id -> (pid, whether it is the main thread) of each thread about to fork; the child
#: is a copy of the forking thread, with the same id, and reads its own entry.
_forking = {}
_hook_installed = False


def _before_fork() -> None:
    _forking[threading.get_ident()] = (os.getpid(),
                                       threading.current_thread() is threading.main_thread())


def _after_fork_in_child() -> None:
    parent, from_main_thread = _forking.get(threading.get_ident(), (None, False))
    if from_main_thread:
        _die_with(parent)


def forked_children_die_with_parent() -> bool:
    """From now on, every child this process (or a child of it) forks from its main thread is
    SIGKILLed by the kernel when its parent dies (Linux; see the module docstring). Installed
    once per process; returns whether the hook is installed."""
    global _hook_installed
    if not sys.platform.startswith("linux"):
        return False
    if not _hook_installed:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _hook_installed = True
    return True
