"""Nothing a rank starts outlives it (megatron_boost/runtime/lifetime.py, docs/design.md §10.4).

A process that imports the package the way ``pretrain_lowrank.py`` does saves a checkpoint with
megatron's dist_checkpointing (which starts a spawn-method Manager server and, with it,
multiprocessing's resource tracker), then is killed with SIGKILL. Every process it started must
be gone within a few seconds. The same for forked processes: a process with the fork hook
forks a child the way megatron's asynchronous save does (``mp.get_context("fork")``), which
forks a grandchild (megatron's shard writer), and is killed; and a training run with
asynchronous saves is killed while its forked background writer runs.
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

FORKS = '''
import multiprocessing as mp
import os
import sys
import time

from megatron_boost.runtime.lifetime import forked_children_die_with_parent


def writer():
    time.sleep(600)


def caller():  # megatron's forked async caller, which forks its writers
    mp.get_context("fork").Process(target=writer).start()
    time.sleep(600)


if __name__ == "__main__":
    if sys.argv[1] == "hook":
        forked_children_die_with_parent()
    mp.get_context("fork").Process(target=caller).start()
    print("forked", flush=True)
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


def _kill_and_find_survivors(rank: subprocess.Popen, expected: int) -> list:
    """SIGKILL ``rank`` once it has ``expected`` descendants; those still running
    :data:`GONE_WITHIN_S` later (the survivors are killed afterwards by the caller)."""
    deadline = time.monotonic() + 240
    children = []
    while len(children) < expected and time.monotonic() < deadline and rank.poll() is None:
        time.sleep(0.1)
        children = psutil.Process(rank.pid).children(recursive=True)
    assert len(children) >= expected, f"only {len(children)} descendants: nothing is tested"
    os.kill(rank.pid, signal.SIGKILL)
    rank.wait(timeout=30)
    deadline = time.monotonic() + GONE_WITHIN_S
    while _alive(children) and time.monotonic() < deadline:
        time.sleep(0.2)
    return children


def test_forked_children_and_theirs_die_with_a_killed_process(tmp_path):
    script = tmp_path / "forks.py"
    script.write_text(FORKS)
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    rank = subprocess.Popen([sys.executable, str(script), "hook"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children = []
    try:
        children = _kill_and_find_survivors(rank, expected=2)
        survivors = _alive(children)
        assert not survivors, f"{len(survivors)} forked processes outlived their killed parent"
    finally:
        for proc in _alive(children):
            proc.kill()
        if rank.poll() is None:
            rank.kill()


def test_a_rank_killed_during_an_asynchronous_save_leaves_no_process(tmp_path):
    """The run sleeps in its background write (``MEGATRON_BOOST_TEST_WRITE_SLEEP``, injected by
    tests/fault_entry.py), in the process megatron forked for it, where the kill comes."""
    from tests import fault_entry
    from tests.test_training import _cmd, _env

    cmd = _cmd(1, ["training.train_iters=4", "checkpoint.save_interval=1",
                   "checkpoint.async_save=true", "training.eval_interval=100",
                   f"logging.run_dir={tmp_path / 'run'}"], entry=fault_entry.PATH)
    env = dict(_env(), MEGATRON_BOOST_TEST_WRITE_SLEEP="600")
    rank = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    children = []
    try:
        forked = []
        deadline = time.monotonic() + 240
        while not forked and time.monotonic() < deadline and rank.poll() is None:
            time.sleep(0.1)
            me = psutil.Process(rank.pid)
            forked = [c for c in me.children() if _cmdline(c) == _cmdline(me)]
        assert forked, "no background writer was forked: nothing is tested"
        children = _kill_and_find_survivors(rank, expected=1)
        survivors = _alive(children)
        assert not survivors, (f"{len(survivors)} of {len(children)} processes of the killed "
                               f"rank still run: {[_cmdline(p)[-3:] for p in survivors]}")
    finally:
        for proc in _alive(children):
            proc.kill()
        if rank.poll() is None:
            rank.kill()


def _cmdline(proc) -> list:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []
