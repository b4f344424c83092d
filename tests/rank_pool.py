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
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Dict, List, Optional

from megatron_boost.runtime.spawn import free_port

#: What a rank runs: the function ``pretrain_lowrank.py`` calls.
ENTRY = "megatron_boost.cli.pretrain:main"

#: torchrun's variables: set per run for a world of several ranks, never left behind.
_LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "MASTER_ADDR", "MASTER_PORT")


def _serve(conn) -> None:
    """A rank process: import the entry point once, then run ``main(argv)`` per request."""
    import torch

    torch.set_num_threads(1)  # as OMP_NUM_THREADS=1 does for the tests' torchrun launches
    importlib.import_module(ENTRY.split(":")[0])  # the heavy imports, once

    while True:
        request = conn.recv()
        if request is None:
            return
        target, env, argv, cwd, out_path, err_path = request
        module, name = target.split(":")
        main = getattr(importlib.import_module(module), name)
        base_env, base_cwd = dict(os.environ), os.getcwd()
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        code = _run_redirected(main, argv, out_path, err_path)
        leftover = _process_left_dirty()
        os.chdir(base_cwd)
        os.environ.clear()
        os.environ.update(base_env)
        conn.send((code, leftover))


def _run_redirected(main, argv, out_path, err_path) -> int:
    """``main(argv)`` with this process's stdout and stderr (file descriptors 1 and 2, so
    output of C++ code lands there too) sent to the two files; its exit status."""
    saved = [os.dup(1), os.dup(2)]
    with open(out_path, "w") as out, open(err_path, "w") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            code = main(argv)
        except SystemExit as stop:  # a process's status: None is 0, a message is 1
            code = 0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1
        except BaseException:  # what an uncaught exception does to a process: traceback, 1
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
    return int(code or 0)


def _process_left_dirty() -> Optional[str]:
    """What a run left active in this process (it must leave nothing: the next run shares it)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_boost.runtime.cpu_mode import is_cpu_mode

    left = [name for name, on in (("a process group", dist.is_initialized()),
                                  ("megatron's model-parallel groups",
                                   parallel_state.model_parallel_is_initialized()),
                                  ("CPU mode", is_cpu_mode())) if on]
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

    def close(self) -> None:
        for proc, conn in self._workers:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc, _ in self._workers:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self._workers = []

    def run(self, world: int, argv: List[str], env: Dict[str, str], cwd: str,
            timeout: float, target: str = ENTRY) -> subprocess.CompletedProcess:
        """``main(argv)`` on ``world`` ranks in directory ``cwd`` with environment ``env`` (plus
        torchrun's variables
        when ``world`` > 1). Like a torchrun launch's result: the exit status is the first
        non-zero rank's, stdout and stderr are the ranks' in rank order."""
        if not 1 <= world <= self.max_world:
            raise ValueError(f"world={world} must be 1..{self.max_world}")
        self._ensure(world)
        base = {k: v for k, v in env.items() if k not in _LAUNCH_ENV}
        port = str(free_port())
        with tempfile.TemporaryDirectory(prefix="rank-pool-") as tmp:
            files = [(Path(tmp) / f"{r}.out", Path(tmp) / f"{r}.err") for r in range(world)]
            for rank, ((_, conn), (out, err)) in enumerate(zip(self._workers, files)):
                rank_env = dict(base)
                if world > 1:
                    rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                                    WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                                    MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                conn.send((target, rank_env, list(argv), str(cwd), str(out), str(err)))
            results = []
            for rank, (proc, conn) in enumerate(self._workers[:world]):
                if not conn.poll(timeout):
                    self.close()  # the other ranks may be stuck in a collective with it
                    raise AssertionError(f"rank {rank} did not finish within {timeout}s:\n"
                                         + _tails(files))
                results.append(conn.recv())
            stdout = "".join(out.read_text(errors="replace") for out, _ in files)
            stderr = "".join(err.read_text(errors="replace") for _, err in files)
        dirty = [f"rank {r}: {left}" for r, (_, left) in enumerate(results) if left]
        if dirty:
            self.close()
            raise AssertionError(f"the run left state behind: {'; '.join(dirty)}\n{stderr}")
        code = next((c for c, _ in results if c != 0), 0)
        return subprocess.CompletedProcess(["main", *argv], code, stdout, stderr)


def _tails(files) -> str:
    return "\n".join(f"--- {p.name} ---\n{p.read_text(errors='replace')[-2000:]}"
                     for pair in files for p in pair if p.exists())


_POOL: Optional[RankPool] = None


def pool() -> RankPool:
    """The session's pool (closed when pytest exits)."""
    global _POOL
    if _POOL is None:
        _POOL = RankPool()
        atexit.register(_POOL.close)
    return _POOL
