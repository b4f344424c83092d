"""No process outlives the test session (docs/testing.md).

At the end of a pytest session (a single process's, or each pytest-xdist worker's: the workers
run the tests) the session's rank pool is closed, then every process this one started, directly
or not, must end within :data:`GRACE_S`. Those still running are named in one ``error:`` line
each, killed, and the session fails. The process's own multiprocessing resource tracker ends
with it and is not counted; an exited child not yet reaped (a zombie) does not run.

"Started by this session" cannot be read from the process tree alone: a process whose parent
ended is adopted by init (or a subreaper) and is no longer a descendant. So the session puts a
token of its own in its environment when it starts (:data:`SESSION_VAR`); every process started
after that inherits it, and at the end every process whose environment holds the token counts,
orphaned or not. A nested session (a test that runs pytest) replaces the token with its own and
checks its processes itself.

conftest.py takes the hook from here; a pytest run of any other test directory can load it with
``-p tests.leak_check`` (tests/test_rank_pool.py leaks a process tree on purpose that way).
"""

from __future__ import annotations

import os
import sys
import time
import uuid
from typing import List

import psutil
import pytest

#: How long the processes left at the end of a session get to finish (tests/test_leak_check.py
#: shortens it for its own sessions through the environment).
GRACE_S = float(os.environ.get("LEAK_CHECK_GRACE_S", "10"))


#: The environment variable that carries the session's token to every process it starts.
SESSION_VAR = "LEAK_CHECK_SESSION"


def _own_resource_tracker() -> int:
    from multiprocessing import resource_tracker

    return getattr(resource_tracker._resource_tracker, "_pid", None) or -1


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _started_by_this_session(proc: psutil.Process, token: str) -> bool:
    try:
        return proc.environ().get(SESSION_VAR) == token
    except psutil.Error:  # ended meanwhile, or not ours to read
        return False


def _session_processes() -> List[psutil.Process]:
    """The running processes this session started: its descendants, and every process that
    carries its token (an orphan is no descendant any more)."""
    me, tracker = psutil.Process(), _own_resource_tracker()
    token = os.environ.get(SESSION_VAR)
    found = {p.pid: p for p in me.children(recursive=True)}
    if token:
        found.update((p.pid, p) for p in psutil.process_iter()
                     if p.pid not in found and _started_by_this_session(p, token))
    return [p for pid, p in found.items() if pid not in (me.pid, tracker) and _running(p)]


def outliving_processes(grace_s: float = GRACE_S) -> List[psutil.Process]:
    """The processes this session started still running after ``grace_s``, but its resource
    tracker."""
    deadline = time.monotonic() + grace_s
    while True:
        alive = _session_processes()
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.2)


def _describe(proc: psutil.Process) -> str:
    try:
        return f"{proc.pid} ({' '.join(proc.cmdline())[:160]})"
    except psutil.Error:
        return str(proc.pid)


def _is_xdist_controller(config) -> bool:
    return getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput")


#: In an xdist controller: what the workers reported (pytest_testnodedown).
_REPORTED_BY_WORKERS: List[str] = []


def _release_checkpoint_results_queue() -> None:
    """End megatron's checkpoint-writer results Manager, as this process's exit would: megatron
    starts it at a process's first save and keeps it, through its module's results queue, for
    the life of the process (docs/design.md §10.4); dropping the queue lets the manager's
    finaliser stop its server process. The session's end stands for the process's end here."""
    import gc

    writer = sys.modules.get("megatron.core.dist_checkpointing.strategies.filesystem_async")
    if writer is not None and getattr(writer, "_results_queue", None) is not None:
        writer._results_queue = None
        gc.collect()


def _end_leftovers() -> List[str]:
    """Close the rank pool and megatron's checkpoint-writer manager, then describe and kill this
    process's descendants still running."""
    pool = sys.modules.get("tests.rank_pool")
    if pool is not None:
        pool.close_pool()
    _release_checkpoint_results_queue()
    left = outliving_processes()
    described = [_describe(proc) for proc in left]
    kill_all(left, wait_s=5)
    return described


def kill_all(procs: List[psutil.Process], wait_s: float = 10.0) -> None:
    """SIGKILL each process (those already gone are skipped) and wait for them to end."""
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=wait_s)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    """Mark every process started from now on as this session's (an xdist controller's token
    reaches its workers, which replace it with their own)."""
    os.environ[SESSION_VAR] = f"{os.getpid()}-{uuid.uuid4().hex}"


def pytest_testnodedown(node, error):
    """xdist controller: collect the leftovers a worker reported (a worker's own session
    status and output do not reach the run's)."""
    _REPORTED_BY_WORKERS.extend(getattr(node, "workeroutput", {}).get("leaked_processes", []))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Fail the session if any process it started still runs once the rank pool is closed."""
    config = session.config
    if _is_xdist_controller(config):
        left = list(_REPORTED_BY_WORKERS)  # the workers, which run the tests, checked theirs
    else:
        left = _end_leftovers()
        if hasattr(config, "workeroutput"):
            config.workeroutput["leaked_processes"] = left  # sent to the controller
    if not left:
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    write = reporter.write_line if reporter is not None else (
        lambda line: print(line, file=sys.stderr))
    for described in left:
        write(f"error: process {described} outlived the test session; the test that started "
              f"it must end it (it is killed now)")
    session.exitstatus = pytest.ExitCode.TESTS_FAILED
