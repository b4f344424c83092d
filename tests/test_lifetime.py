"""Nothing a rank starts outlives it (megatron_boost/runtime/lifetime.py, docs/design.md §10.4).

A process that imports the package the way ``pretrain_lowrank.py`` does saves a checkpoint with
megatron's dist_checkpointing (which starts a spawn-method Manager server and, with it,
multiprocessing's resource tracker), then is killed with SIGKILL. Every process it started must
be gone within a few seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]

RANK = '''
import megatron_boost  # noqa: F401  (as pretrain_lowrank.py does, outside the main guard)

if __name__ == "__main__":
    import sys
    import time

    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_boost.runtime.cpu_mode import use_cpu
    from megatron_boost.train.distributed import init_world_of_one

    use_cpu(force=True)
    init_world_of_one("gloo")
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(4), replica_id=0)}
    dist_checkpointing.save(state, sys.argv[1])
    print("saved", flush=True)
    time.sleep(600)
'''

# The kernel delivers the parent-death signal at once; the bound only covers a loaded machine.
GONE_WITHIN_S = 20


def _alive(procs):
    """Those of ``procs`` (psutil processes) still running. A psutil process is its pid and
    its start time, so a pid the kernel has handed to a new process since (pids wrap at
    kernel.pid_max, 32768 here) does not count, and is not killed."""
    out = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.NoSuchProcess:
            pass
    return out


def test_children_of_a_killed_rank_exit(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    (tmp_path / "ckpt").mkdir()
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    rank = subprocess.Popen([sys.executable, str(script), str(tmp_path / "ckpt")], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    children = []
    try:
        deadline = time.monotonic() + 240
        line = ""
        while "saved" not in line and time.monotonic() < deadline and rank.poll() is None:
            line = rank.stdout.readline()
        assert "saved" in line, "the rank did not save its checkpoint"
        children = psutil.Process(rank.pid).children(recursive=True)
        assert children, "dist_checkpointing started no helper process: nothing is tested"
        os.kill(rank.pid, signal.SIGKILL)
        rank.wait(timeout=30)
        deadline = time.monotonic() + GONE_WITHIN_S
        while _alive(children) and time.monotonic() < deadline:
            time.sleep(0.2)
        survivors = _alive(children)
        assert not survivors, (f"{len(survivors)} of {len(children)} processes started by the "
                               f"killed rank still run after {GONE_WITHIN_S} s: "
                               f"{[p.cmdline() for p in survivors]}")
    finally:
        for proc in _alive(children):
            proc.kill()  # only processes this test started (psutil checks the start time)
        if rank.poll() is None:
            rank.kill()
