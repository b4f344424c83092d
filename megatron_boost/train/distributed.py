"""torch.distributed process group of a run: init (also for a plain one-process launch),
rank-0 printing and shutdown."""

from __future__ import annotations

import contextlib
import datetime
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_boost.compat import check_megatron_version

__all__ = ["init_distributed", "init_world_of_one", "launched_by_torchrun", "shutdown", "print0",
           "groups_released"]


def init_distributed(device: str, timeout: datetime.timedelta) -> None:
    """Join the process group torchrun describes (nccl on GPU, gloo on CPU); without torchrun
    (``python pretrain_lowrank.py``), a world of one. ``timeout`` bounds every collective
    (``parallel.timeout_minutes``). A megatron-core outside the tested range stops here, before
    any distributed work (``ValueError``, one line)."""
    check_megatron_version()
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if dist.is_initialized():
        return
    backend = "nccl" if device == "cuda" else "gloo"
    if launched_by_torchrun():
        dist.init_process_group(backend, timeout=timeout)
        return
    init_world_of_one(backend, timeout)


def init_world_of_one(backend: str = "gloo",
                      timeout: datetime.timedelta = datetime.timedelta(minutes=30)) -> None:
    """A process group of this process alone. It needs no rendezvous: an in-memory store
    instead of a TCP port, which another process could take between choosing it and binding
    it. Checks megatron-core's version first, as :func:`init_distributed` does."""
    check_megatron_version()
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timeout)


def launched_by_torchrun() -> bool:
    """True when the environment describes a rendezvous (torchrun, srun + torchrun)."""
    return "RANK" in os.environ and "MASTER_ADDR" in os.environ


def shutdown() -> None:
    """Destroy megatron's groups and the process group (best effort, at exit)."""
    try:
        if dist.is_initialized():
            ps.destroy_model_parallel()
            dist.destroy_process_group()
    except Exception:  # pragma: no cover - best effort at exit
        pass


def _registered_groups() -> set:
    """The process groups torch.distributed holds registered in this process (the default one
    included); torch has no public list of them."""
    return set(dist.distributed_c10d._world.pg_map)


@contextlib.contextmanager
def groups_released():
    """megatron's model-parallel groups, and every other process group made inside the block
    (a model build makes one, model/specs.py), destroyed at its end. megatron's
    ``destroy_model_parallel`` only forgets its groups (it destroys just its gloo copies of the
    data-parallel ones): torch.distributed keeps the rest registered until the default group
    ends, and each gloo group keeps its threads running until then, so a process that sets up
    one layout after another (the test suite's layout checks) would gather about fifty
    threads per layout at world 4."""
    before = _registered_groups()
    try:
        yield
    finally:
        ps.destroy_model_parallel()
        if dist.is_initialized():  # the default group is the caller's to end
            for group in _registered_groups() - before - {dist.group.WORLD}:
                dist.destroy_process_group(group)


def print0(*args, **kwargs) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)
