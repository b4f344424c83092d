"""Trainer runs without process start-up: rank processes that stay up between runs.

A torchrun launch of ``configs/debug.yaml`` spends most of its time starting processes (torchrun,
then torch and megatron-core imported by every rank), not training. Tests whose subject is what
a run computes (losses, metrics, checkpoints, resume, resharding, precision) rather than how it
is launched run the entry point's ``main(argv)`` (``megatron_boost/cli/pretrain.py``, which is
all ``pretrain_lowrank.py`` runs) in these processes instead, with the environment torchrun
gives a rank (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``), or
none for one process, as ``python pretrain_lowrank.py`` has. ``main`` is written to run in a
process that goes on (it leaves CPU mode, signal handlers and the process groups as it found
them), and a run that did not leave the process clean fails here.

What is tested *as* a launch stays one: the fault-tolerance tests (kill, hang, signals), the
SIGUSR1 test of tests/test_training.py, the Slurm tests, the README walk-through and the
bad-input table's process cases start real processes.

The same processes run the tests' gloo jobs: :func:`distributed` is
``megatron_boost/runtime/spawn.py``'s ``run_distributed`` (a gloo group over the ranks, CPU
mode, ``fn(rank, world, *args)``, the per-rank results) without starting the processes; the
product's ``run_distributed`` stays tested through the tools that call it
(``tools/verify_parallel.py``, ``tools/benchmark.py``) as processes.
"""

from __future__ import annotations

import atexit
import functools
import gc
import importlib
import io
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from multiprocessing.connection import wait
from typing import Any, Callable, Dict, List, Optional

from megatron_boost.runtime.spawn import free_port

#: What a rank runs: the function ``pretrain_lowrank.py`` calls.
ENTRY = "megatron_boost.cli.pretrain:main"

#: A rank process retires after a job that leaves it with more threads than this: a gloo
#: group's polling thread can outlive the group (about one per trainer run after garbage
#: collection), and each costs CPU for the rest of the session.
MAX_THREADS = 48

#: torchrun's variables: set per run for a world of several ranks, never left behind.
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "MASTER_ADDR", "MASTER_PORT")


def _serve(conn) -> None:
    """A rank process: import the entry point once, then run one job per request, in the
    request's environment and directory, with its output sent to the request's files."""
    import torch

    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 does for the tests' torchrun launches
    importlib.import_module(ENTRY.split(":")[0])  # the heavy imports, once

    while True:
        request = conn.recv()
        if request is None:
            return
        job, env, cwd, out_path, err_path = request
        base_env, base_cwd = dict(os.environ), os.getcwd()
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        outcome = _redirected(job, out_path, err_path)
        # What the job dropped is freed now, not at some later allocation: the gloo groups it
        # made each keep a polling thread until their last reference goes.
        gc.collect()
        leftover = _process_left_dirty()
        os.chdir(base_cwd)
        os.environ.clear()
        os.environ.update(base_env)
        retiring = len(os.listdir("/proc/self/task")) > MAX_THREADS
        conn.send((outcome, leftover, retiring))
        if retiring:
            return  # the pool starts a fresh process for the next job


def _redirected(job: Callable[[], Any], out_path: str, err_path: str) -> Any:
    """``job()`` with this process's stdout and stderr (file descriptors 1 and 2, so output of
    C++ code lands there too) sent to the two files."""
    saved = [os.dup(1), os.dup(2)]
    with open(out_path, "w") as out, open(err_path, "w") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            return job()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def _main_job(target: str, argv: List[str]) -> int:
    """A rank of a launch: ``main(argv)`` of ``target`` (``module:function``); its exit status."""
    module, name = target.split(":")
    main = getattr(importlib.import_module(module), name)
    try:
        code = main(argv)
    except SystemExit as stop:  # a process's status: None is 0, a message is 1
        code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
    except BaseException:  # what an uncaught exception does to a process: traceback, 1
        traceback.print_exc()
        code = 1
    return int(code or 0)


def _gloo_job(fn: Callable, args: tuple) -> tuple:
    """A rank of :func:`distributed`: what ``run_distributed``'s worker does (CPU mode, a gloo
    group from torchrun's variables, ``fn(rank, world, *args)``), leaving CPU mode, megatron's
    groups and the process group as they were. ``("ok", result as torch.save bytes)`` or
    ``("error", traceback)``."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_boost.runtime.cpu_mode import cpu_mode_left_as_found, use_cpu

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        with cpu_mode_left_as_found():
            use_cpu(force=True)
            dist.init_process_group("gloo", rank=rank, world_size=world)
            try:
                result = fn(rank, world, *args)
            finally:
                parallel_state.destroy_model_parallel()
                dist.destroy_process_group()
        buf = io.BytesIO()  # bytes: tensors sent as they are would share this process's memory
        torch.save(result, buf)
        return "ok", buf.getvalue()
    except BaseException:  # report every failure, including assertion errors
        return "error", traceback.format_exc()


def _process_left_dirty() -> Optional[str]:
    """What a run left active in this process (it must leave nothing: the next run shares it)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_boost.runtime.cpu_mode import is_cpu_mode

    import torch

    left = [name for name, on in (("a process group", dist.is_initialized()),
                                  ("megatron's model-parallel groups",
                                   parallel_state.model_parallel_is_initialized()),
                                  ("CPU mode", is_cpu_mode()),
                                  ("a torch function mode",
                                   bool(torch.overrides._get_current_function_mode_stack())))
            if on]
    return ", ".join(left) or None


class RankPool:
    """Up to ``max_world`` rank processes (spawned, so they share nothing with pytest's), started
    on first use and kept until the session ends."""

    def __init__(self, max_world: int = 4):
        self.max_world = max_world
        self._ctx = mp.get_context("spawn")
        self._workers: List[tuple] = []  # (process, connection)

    def _ensure(self, world: int) -> None:
        self._workers = [(p, c) for p, c in self._workers if p.is_alive()]
        while len(self._workers) < world:
            parent, child = self._ctx.Pipe()
            # Not a daemon: a rank starts processes of its own (dist_checkpointing's writers).
            # It still ends with pytest: close() at exit, and importing megatron_boost makes
            # it die with its parent (megatron_boost/runtime/lifetime.py).
            proc = self._ctx.Process(target=_serve, args=(child,))
            proc.start()
            child.close()
            self._workers.append((proc, parent))

    def close(self, wait_s: float = 10.0) -> None:
        """Ask the processes to exit; kill those still running after ``wait_s`` (0: at once,
        for processes known to be stuck)."""
        for proc, conn in self._workers:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc, _ in self._workers:
            proc.join(timeout=wait_s)
            if proc.is_alive():
                _kill_tree(proc)
        self._workers = []

    def run(self, world: int, argv: List[str], env: Dict[str, str], cwd: str,
            timeout: float, target: str = ENTRY) -> subprocess.CompletedProcess:
        """``main(argv)`` on ``world`` ranks in directory ``cwd`` with environment ``env`` (plus
        torchrun's variables when ``world`` > 1). Like a torchrun launch's result: the exit
        status is the first non-zero rank's, stdout and stderr are the ranks' in rank order."""
        job = functools.partial(_main_job, target, list(argv))
        codes, stdout, stderr = self._dispatch(world, job, env, cwd, timeout,
                                               launch_env=world > 1, failed=bool)
        # a rank killed after another failed (None) failed too, as torchrun reports it
        code = next((1 if c is None else c for c in codes if c != 0), 0)
        return subprocess.CompletedProcess(["main", *argv], code, stdout, stderr)

    def distributed(self, fn: Callable, world: int, *args, timeout: float = 300.0) -> list:
        """``fn(rank, world, *args)`` on ``world`` ranks joined in a gloo group, in CPU mode;
        the per-rank return values, as ``run_distributed`` returns them. A failing rank raises
        ``RuntimeError`` with its traceback (and the ranks' output goes to this process's
        stdout and stderr, where pytest shows it)."""
        job = functools.partial(_gloo_job, fn, args)
        outcomes, stdout, stderr = self._dispatch(
            world, job, dict(os.environ), os.getcwd(), timeout, launch_env=True,
            failed=lambda outcome: outcome[0] == "error")
        sys.stdout.write(stdout)
        sys.stderr.write(stderr)
        errors = [f"--- rank {r} ---\n{outcome[1]}" for r, outcome in enumerate(outcomes)
                  if outcome is not None and outcome[0] == "error"]
        if errors:
            raise RuntimeError("distributed worker failed:\n" + "\n".join(errors))
        import torch

        return [torch.load(io.BytesIO(payload), weights_only=False) for _, payload in outcomes]

    def _dispatch(self, world: int, job: Callable, env: Dict[str, str], cwd: str,
                  timeout: float, launch_env: bool, failed: Callable[[Any], bool]):
        """``job`` on ranks 0..world-1: (their outcomes in rank order, stdout, stderr). Once
        a rank has ``failed``, the ranks still running may wait forever in a collective with
        it: they are killed after a grace period, and report ``None``."""
        if not 1 <= world <= self.max_world:
            raise ValueError(f"world={world} must be 1..{self.max_world}")
        self._ensure(world)
        base = {k: v for k, v in env.items() if k not in _LAUNCH_ENV}
        port = str(free_port())
        with tempfile.TemporaryDirectory(prefix="rank-pool-") as tmp:
            files = [(Path(tmp) / f"{r}.out", Path(tmp) / f"{r}.err") for r in range(world)]
            for rank, ((_, conn), (out, err)) in enumerate(zip(self._workers, files)):
                rank_env = dict(base)
                if launch_env:
                    rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                                    WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                                    MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                conn.send((job, rank_env, str(cwd), str(out), str(err)))
            results = self._collect(world, timeout, failed, files)
            stdout = "".join(out.read_text(errors="replace") for out, _ in files)
            stderr = "".join(err.read_text(errors="replace") for _, err in files)
        self._drop_retired([r for r, (_, _, retiring) in enumerate(results) if retiring])
        dirty = [f"rank {r}: {left}" for r, (_, left, _) in enumerate(results) if left]
        if dirty:
            self.close()
            raise AssertionError(f"the run left state behind: {'; '.join(dirty)}\n{stderr}")
        return [outcome for outcome, _, _ in results], stdout, stderr

    def _drop_retired(self, ranks: List[int]) -> None:
        """Forget the processes of ``ranks``, which exit after their job (MAX_THREADS)."""
        retired = [self._workers[r] for r in ranks if r < len(self._workers)]  # none if closed
        for proc, _ in retired:
            proc.join(timeout=30)
        self._workers = [w for w in self._workers if w not in retired]

    #: Seconds the other ranks get to finish once one has failed.
    FAILURE_GRACE = 30.0

    def _collect(self, world: int, timeout: float, failed: Callable[[Any], bool], files):
        """Each rank's (outcome, what it left behind), waiting at most ``timeout``."""
        conns = {self._workers[r][1]: r for r in range(world)}
        results: Dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        while len(results) < world:
            pending = [conn for conn, rank in conns.items() if rank not in results]
            ready = wait(pending, max(0.0, deadline - time.monotonic()))
            if not ready:
                late = sorted(set(range(world)) - set(results))
                self.close(wait_s=0)  # stuck, e.g. in a collective with a failed rank
                if any(failed(outcome) for outcome, _, _ in results.values()):
                    return [results.get(r, (None, None, False)) for r in range(world)]
                raise AssertionError(f"rank {late[0]} did not finish within {timeout}s:\n"
                                     + _tails(files))
            for conn in ready:
                results[conns[conn]] = conn.recv()
                if failed(results[conns[conn]][0]):
                    deadline = min(deadline, time.monotonic() + self.FAILURE_GRACE)
        return [results[r] for r in range(world)]


def _kill_tree(proc) -> None:
    """Kill a rank process and every process it started. A rank that exits stops its helpers
    (megatron's checkpoint-writer manager among them), but a killed one cannot; its helpers,
    started from this pool's ``__main__`` rather than a launch script, do not import
    megatron_boost and so do not die with their parent (megatron_boost/runtime/lifetime.py):
    they are found before the kill, while they are still the rank's descendants."""
    import psutil

    from tests.leak_check import kill_all

    try:
        helpers = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        helpers = []
    proc.kill()
    proc.join()
    kill_all(helpers)


def _tails(files) -> str:
    return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-2000:]}"
                     for pair in files for p in pair if p.exists())


_POOL: Optional[RankPool] = None


def distributed(fn: Callable, world: int, *args, timeout: float = 300.0) -> list:
    """:meth:`RankPool.distributed` on the session's pool: ``run_distributed`` for tests."""
    return pool().distributed(fn, world, *args, timeout=timeout)


def close_pool() -> None:
    """Close the session's pool, if it was started (the end-of-session process check,
    tests/leak_check.py, runs after it)."""
    global _POOL
    if _POOL is not None:
        _POOL.close()
        _POOL = None


def pool() -> RankPool:
    """The session's pool (closed when pytest exits)."""
    global _POOL
    if _POOL is None:
        _POOL = RankPool()
        atexit.register(_POOL.close)
    return _POOL
