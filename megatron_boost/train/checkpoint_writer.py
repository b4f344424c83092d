"""Writing checkpoints, synchronously or in the background, always through the commit protocol
of :mod:`megatron_boost.train.checkpoint_guard`.

Synchronous (``checkpoint.async_save: false``): ``dist_checkpointing.save`` into the temp
directory; every rank fsyncs and CRCs its own shard files at once, and rank 0 commits with
their entries (manifest, fsync, rename, tracker) while the others wait for that short part.

Asynchronous (``checkpoint.async_save: true``): ``dist_checkpointing.save(...,
async_sharded_save=True)`` with megatron's own ``mcore`` strategy (:func:`megatron_boost.compat.
save_sharded`) writes the common state, stages the shards and returns megatron's
``AsyncRequest``; the strategy's matching ``AsyncCallsQueue``
(:func:`megatron_boost.compat.async_calls_queue`) writes the shards in a background process
while training continues. :meth:`CheckpointWriter.poll` (every step, on every rank) runs the
finalization once all ranks' writes are done: megatron's own (``metadata.json``, a barrier),
then our commit on rank 0. So the tracker moves only after a complete checkpoint, and a kill
during the background write leaves it naming the previous one. At most one save is in
flight: a new save first waits for the previous (:meth:`wait`).

A write the file system refuses (full, quota, ``ulimit -f``, read-only, permission), in the
save or in its background part, raises :class:`~megatron_boost.train.save_faults.
CheckpointSaveFailed`: one line naming the file and saying the last complete checkpoint is
intact.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Optional, Sequence, Tuple

from megatron_boost.compat import async_calls_queue, save_sharded
from megatron_boost.train.checkpoint_guard import (
    commit_checkpoint,
    iter_dir_name,
    prune_checkpoints,
    shard_entries,
    temp_dir_for,
)
from megatron_boost.train.callbacks import TrainerCallback
from megatron_boost.train.save_faults import explain_save_fault, quiet_writer_failure_logs

__all__ = ["CheckpointWriter"]


class CheckpointWriter:
    """Saves sharded state dicts under ``save_dir`` (see the module docstring)."""

    def __init__(self, save_dir: str, async_save: bool, keep_last: Optional[int],
                 callbacks: Sequence[TrainerCallback] = ()):
        self.save_dir = Path(save_dir)
        self.async_save, self.keep_last = async_save, keep_last
        self.callbacks = tuple(callbacks)  # train/callbacks.py; usually none
        self.queue = None
        self.in_flight: Optional[Tuple[int, Path]] = None  # (iteration, temp dir) being saved
        quiet_writer_failure_logs()
        if async_save:
            self.queue = async_calls_queue()

    def _prepare(self, iteration: int) -> Path:
        import torch.distributed as dist

        temp = temp_dir_for(self.save_dir / iter_dir_name(iteration))
        if dist.get_rank() == 0:
            if temp.exists():  # the leftover of an interrupted save
                shutil.rmtree(temp)
            temp.mkdir(parents=True)
        dist.barrier()
        return temp

    def _commit_fn(self, temp: Path, iteration: int):
        def commit():
            import torch.distributed as dist

            for callback in self.callbacks:
                callback.before_checkpoint_commit(iteration)
            rank, world = dist.get_rank(), dist.get_world_size()
            shares = [None] * world  # each rank's fsynced, CRC'd shard files, in parallel
            dist.all_gather_object(shares, shard_entries(temp, rank, world))
            if rank == 0:
                entries = {name: e for share in shares for name, e in share.items()}
                commit_checkpoint(temp, self.save_dir / iter_dir_name(iteration), iteration,
                                  entries)
                prune_checkpoints(self.save_dir, self.keep_last)
            dist.barrier()
            self.in_flight = None
        return commit

    @contextlib.contextmanager
    def _refused_writes_as_one_line(self):
        """A refused write of the save in flight becomes :class:`CheckpointSaveFailed`."""
        try:
            yield
        # torch.distributed.checkpoint's CheckpointException is a BaseException
        except BaseException as err:  # noqa: BLE001 - anything else is re-raised as it is
            if self.in_flight is None or isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            fault = explain_save_fault(err, *self.in_flight, self.save_dir)
            if fault is None:
                raise
            raise fault from err

    def save(self, sharded_sd: dict, iteration: int) -> None:
        """Save (or start saving in the background) ``sharded_sd`` as iteration
        ``iteration``."""
        self.wait()
        self.in_flight = (iteration, temp_dir_for(self.save_dir / iter_dir_name(iteration)))
        with self._refused_writes_as_one_line():
            temp = self._prepare(iteration)
            commit = self._commit_fn(temp, iteration)
            if not self.async_save:
                save_sharded(sharded_sd, str(temp), async_save=False)
                commit()
                return
            request = save_sharded(sharded_sd, str(temp), async_save=True)
            for callback in self.callbacks:
                request = callback.on_async_save(request)
            request.add_finalize_fn(commit)
            self.queue.schedule_async_request(request)

    def poll(self) -> None:
        """Commit finished background saves (call on every rank, every step)."""
        if self.queue is not None:
            with self._refused_writes_as_one_line():
                self.queue.maybe_finalize_async_calls(blocking=False)

    def wait(self) -> None:
        """Block until every background save is committed."""
        if self.queue is not None:
            with self._refused_writes_as_one_line():
                self.queue.maybe_finalize_async_calls(blocking=True)

    def close(self) -> None:
        if self.queue is not None:
            self.wait()
            self.queue.close()
