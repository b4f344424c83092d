"""The rank pool (tests/rank_pool.py) that the trainer tests and the gloo jobs run on: a run in
it is the run a torchrun launch makes, a gloo job returns what ``run_distributed`` returns, and
a run or job that leaves state behind in its processes fails."""

from __future__ import annotations

import os
import re
import time

import pytest
import torch

from tests.convert_fixtures import torchrun
from megatron_boost.runtime.spawn import run_distributed
from tests.rank_pool import distributed, pool
from tests.test_bad_input import error_messages
from tests.test_training import DEBUG, ROOT, _env, losses, metrics, run_training

RUN = ["parallel.tp=2", "training.train_iters=3", "training.eval_interval=3",
       "logging.log_interval=1", "checkpoint.save_interval=3"]


def test_a_pool_run_is_the_run_torchrun_launches(tmp_path):
    """The same configuration launched by torchrun and run in the pool: the same losses, grad
    norms and learning rates, bit for bit (same code, same seeds, same arithmetic), and the
    same console lines apart from the throughput columns."""
    launched, pooled = tmp_path / "launched", tmp_path / "pooled"
    out = torchrun(2, "pretrain_lowrank.py", ["--config", DEBUG, *RUN,
                                              f"logging.run_dir={launched}"])
    proc = run_training(2, RUN + [f"logging.run_dir={pooled}"])
    assert losses(pooled) == losses(launched) and sorted(losses(pooled)) == [1, 2, 3]
    for a, b in zip(metrics(launched), metrics(pooled)):
        assert (a["grad_norm"], a["lr"]) == (b["grad_norm"], b["lr"])

    def steady(text):  # the lines, without the columns that depend on timing or the host
        timed = ("tok/s", "TFLOP/s", "MFU", "peak mem", "elapsed", "ETA")
        return [" | ".join(re.sub(r" \(\d+(\.\d+)?s\)$", "", field)
                           for field in line.split(" | ") if not any(t in field for t in timed))
                for line in text.splitlines()
                if line.startswith(("iter ", "budget:", "  validation"))]
    assert steady(proc.stdout) == [line.replace(str(launched), str(pooled))
                                   for line in steady(out)]


def leave_a_process_group(argv):
    """A stand-in entry point that forgets to shut its process group down."""
    import torch.distributed as dist

    from megatron_boost.train.distributed import init_world_of_one

    init_world_of_one()
    return 0 if dist.is_initialized() else 1


def test_a_run_that_leaves_a_process_group_fails(tmp_path):
    with pytest.raises(AssertionError, match="left state behind: rank 0: a process group"):
        pool().run(1, [], env=dict(os.environ), cwd=str(ROOT), timeout=120,
                   target="tests.test_rank_pool:leave_a_process_group")
    # the pool replaced that process: the next run works
    run_training(1, ["training.train_iters=1", "optimizer.warmup_iters=0",
                     "training.eval_iters=0", "checkpoint.save_interval=100",
                     f"logging.run_dir={tmp_path}"])


def test_a_failing_rank_gives_the_status_and_output_of_a_failed_launch(tmp_path):
    """A ValueError before training: status 2 and the one error line, as from a process."""
    proc = pool().run(2, ["--config", DEBUG, "parallel.tp=2", "model.hiden_size=3",
                          f"logging.run_dir={tmp_path}"], env=_env(), cwd=str(ROOT),
                      timeout=120)
    assert proc.returncode == 2
    # one message, from each rank that got to it (ranks other than 0 name themselves)
    errors = error_messages(proc.stderr.splitlines())
    assert len(errors) == 1 and "hiden_size" in min(errors), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def gloo_facts(rank, world, seed):
    """A gloo job's view: its rank and world, CPU mode, the device megatron's code gets, and
    a reduction over the group of a seeded draw."""
    import torch
    import torch.distributed as dist

    from megatron_boost.runtime.cpu_mode import is_cpu_mode

    torch.manual_seed(seed + rank)
    value = torch.randn(4)
    dist.all_reduce(value)
    return {"rank": (rank, dist.get_rank()), "world": (world, dist.get_world_size()),
            "cpu": is_cpu_mode(), "device": torch.empty(1, device="cuda").device.type,
            "sum": value}


def test_a_gloo_job_returns_what_run_distributed_returns():
    spawned = run_distributed(gloo_facts, 2, 7)
    pooled = distributed(gloo_facts, 2, 7)
    assert [r["rank"] for r in pooled] == [(0, 0), (1, 1)]
    assert all(r["world"] == (2, 2) and r["cpu"] and r["device"] == "cpu" for r in pooled)
    for a, b in zip(spawned, pooled):
        assert torch.equal(a.pop("sum"), b.pop("sum")) and a == b


def fail_on_rank_1(rank, world):
    """Rank 1 fails; rank 0 never returns (as a rank stuck in a collective does)."""
    import time

    if rank == 1:
        raise ValueError("rank 1 broke")
    time.sleep(600)


def test_a_failing_gloo_rank_raises_its_traceback_and_the_waiting_rank_is_ended(monkeypatch):
    monkeypatch.setattr(pool(), "FAILURE_GRACE", 1.0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)--- rank 1 ---.*ValueError: rank 1 broke"):
        distributed(fail_on_rank_1, 2, timeout=120)
    assert time.monotonic() - start < 60  # ended after the grace, not at the timeout
    assert distributed(gloo_facts, 1, 0)[0]["world"] == (1, 1)  # new processes, working


class _Forgotten(torch.overrides.TorchFunctionMode):
    pass


def enter_a_function_mode(rank, world):
    """A job that enters a torch function mode and never leaves it."""
    _Forgotten().__enter__()


def test_a_gloo_job_that_leaves_a_function_mode_fails():
    with pytest.raises(AssertionError, match="left state behind: rank 0: .*a torch function mode"):
        distributed(enter_a_function_mode, 1)


def leave_threads(rank, world, count):
    """A job that leaves ``count`` threads running (as leaked gloo polling threads do); its
    process id."""
    import threading

    stop = threading.Event()
    for _ in range(count):
        threading.Thread(target=stop.wait, daemon=True).start()
    return os.getpid()


def test_a_process_left_with_too_many_threads_is_replaced():
    from tests.rank_pool import MAX_THREADS

    first = distributed(leave_threads, 1, 0)[0]
    assert distributed(leave_threads, 1, MAX_THREADS)[0] == first  # kept until now
    replaced = distributed(leave_threads, 1, 0)[0]
    assert replaced != first and distributed(leave_threads, 1, 0)[0] == replaced


def test_rendezvous_ports_are_drawn_below_the_ephemeral_range():
    """The pool's and ``run_distributed``'s rendezvous port: bindable, outside the range the
    kernel gives outgoing connections (another process's gloo connections would otherwise take
    it before the store binds it), and not the same sequence in processes seeded alike."""
    import random

    from megatron_boost.runtime import spawn

    low = spawn._ephemeral_start()
    ports = [spawn.free_port() for _ in range(200)]
    assert all(low - spawn._PORT_WINDOW <= p < low for p in ports), sorted(ports)[-5:]
    assert all(spawn._can_bind(p) for p in ports[:20])
    draws = []
    for _ in range(2):
        random.seed(1234)  # as training seeds every rank
        draws.append([spawn.free_port() for _ in range(8)])
    assert draws[0] != draws[1]
