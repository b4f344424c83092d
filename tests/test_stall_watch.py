"""A dead or hung rank named on NCCL too (train/resilience.py ``StallWatch``,
docs/fault-tolerance.md): on NCCL a collective waiting for a missing peer raises nothing in the
trainer (the host blocks in its next device read and NCCL's watchdog aborts the process at the
group's timeout), so a thread asks the gloo side channel who is missing once the training step
has run ``parallel.timeout_minutes``, and the NCCL groups get a longer timeout so that it
reports first.

What gloo allows on CPU: the watch in two gloo ranks, the main thread of one blocked inside its
step as it would be in NCCL's device read, the other stuck outside its step; and the timeout
and backend handed to ``init_process_group`` for a CUDA run. NCCL itself (the watchdog's abort,
the host blocking in a device read) is not run here.
"""

from __future__ import annotations

import datetime

import pytest

from tests.rank_pool import distributed

DEADLINE_S = 2.0  # parallel.timeout_minutes = 2 s


def _watched(rank, world, deadline_s):
    import threading
    import time

    import torch
    import torch.distributed as dist

    from megatron_boost.train.resilience import (
        RankMonitor,
        StallWatch,
        collective_timeout,
        stall_barrier_window,
    )

    minutes = deadline_s / 60

    def watch_until_reported(stuck_inside: bool, iteration: int):
        # a group per case: a run's watch reports once, and the process ends
        monitor = RankMonitor(datetime.timedelta(seconds=deadline_s))
        reported, done = [], threading.Event()

        def on_stall(err):
            reported.append((str(err), time.monotonic() - t0))
            done.set()

        watch = StallWatch(monitor, datetime.timedelta(seconds=deadline_s),
                           stall_barrier_window(minutes), on_stall, poll_s=0.1).start()
        t0 = time.monotonic()
        try:
            if stuck_inside:  # waits in its step for a peer, as NCCL's device read would
                with watch.step(iteration):
                    done.wait(collective_timeout(minutes, "cuda").total_seconds())
            else:  # stuck before its step: the watch never asks
                time.sleep(deadline_s + stall_barrier_window(minutes).total_seconds() + 1)
        finally:
            watch.stop()
        return reported

    # rank 1 stuck outside its step: rank 0 names it; then both stuck inside the step
    named = watch_until_reported(stuck_inside=rank == 0, iteration=7)
    dist.barrier()
    inside = watch_until_reported(stuck_inside=True, iteration=9)
    dist.all_reduce(torch.zeros(1))  # both watches have ended
    return {"named": named, "inside": inside,
            "nccl_timeout_s": collective_timeout(minutes, "cuda").total_seconds()}


@pytest.mark.compat
def test_the_watch_names_a_rank_stuck_outside_its_step_before_the_nccl_timeout():
    rank0, rank1 = distributed(_watched, 2, DEADLINE_S, timeout=120)
    (message, elapsed), = rank0["named"]
    assert message.startswith("rank 1 did not respond within ") and "iteration 7" in message
    assert "parallel.timeout_minutes" in message
    # after the deadline, and well before NCCL's watchdog would abort the process
    assert DEADLINE_S <= elapsed < rank0["nccl_timeout_s"] - 30, elapsed
    assert rank1["named"] == []  # outside its step: no report of its own
    for out in (rank0, rank1):  # every rank inside the step: nobody is missing, all stop
        (message, elapsed), = out["inside"]
        assert message.startswith("every rank is inside the step") and "iteration 9" in message
        assert elapsed < out["nccl_timeout_s"] - 30, elapsed


@pytest.mark.fast
def test_a_cuda_run_gives_nccl_a_timeout_the_watch_reports_within(monkeypatch):
    import torch
    import torch.distributed as dist

    from megatron_boost.train import distributed as td
    from megatron_boost.train.resilience import (
        STALL_REPORT_MARGIN,
        collective_timeout,
        process_group_timeout,
        stall_barrier_window,
    )

    for minutes in (0.1, 30.0):
        deadline = process_group_timeout(minutes)
        assert collective_timeout(minutes, "cpu") == deadline  # gloo raises: no watch
        nccl = collective_timeout(minutes, "cuda")
        assert nccl >= deadline + stall_barrier_window(minutes) + STALL_REPORT_MARGIN
    assert stall_barrier_window(30.0) == datetime.timedelta(seconds=60)

    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend, timeout: seen.update(backend=backend, timeout=timeout))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    td.init_distributed("cuda", collective_timeout(0.5, "cuda"))
    assert seen == {"backend": "nccl", "timeout": collective_timeout(0.5, "cuda")}
