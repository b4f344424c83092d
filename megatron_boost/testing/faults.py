"""Fault injection for the fault-tolerance tests, installed from outside the product.

The trainer knows nothing of it: :class:`FaultInjector` is a trainer callback
(``megatron_boost/train/callbacks.py``), and the tests launch the trainer through
``tests/fault_entry.py``, which calls the real entry point's ``main`` with the callbacks
:func:`callbacks_from_env` builds (under torchrun, under the launcher with ``--entry``, and in
the tests' rank pool). The faults come from environment variables, which torchrun passes to
every rank; this module alone reads them:

* ``MEGATRON_BOOST_TEST_NAN_AT=<first>[-<last>]:<rank>`` makes that rank's loss NaN at those
  iterations;
* ``MEGATRON_BOOST_TEST_HANG_AT=<iteration>:<rank>`` makes that rank stop responding before
  that iteration (stuck in communication: see :meth:`FaultInjector.maybe_hang`);
* ``MEGATRON_BOOST_TEST_SAVE_SLEEP=<seconds>`` sleeps after the shards are written and before
  the checkpoint is committed (a window to kill a rank in);
* ``MEGATRON_BOOST_TEST_WRITE_SLEEP=<seconds>`` makes an asynchronous save's background
  process (forked by megatron) sleep before it writes (a window to kill a rank while it runs).
"""

from __future__ import annotations

import datetime
import functools
import os
import re
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from megatron_boost.train.callbacks import TrainerCallback

__all__ = ["FaultInjector", "callbacks_from_env", "ENV_NAN_AT", "ENV_HANG_AT", "ENV_SAVE_SLEEP",
           "ENV_WRITE_SLEEP"]

ENV_NAN_AT = "MEGATRON_BOOST_TEST_NAN_AT"
ENV_HANG_AT = "MEGATRON_BOOST_TEST_HANG_AT"
ENV_SAVE_SLEEP = "MEGATRON_BOOST_TEST_SAVE_SLEEP"
ENV_WRITE_SLEEP = "MEGATRON_BOOST_TEST_WRITE_SLEEP"
_SPEC = re.compile(r"^(\d+)(?:-(\d+))?:(\d+)$")


def _parse_spec(name: str) -> Optional[Tuple[int, int, int]]:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    match = _SPEC.match(text)
    if match is None:
        raise ValueError(f"{name}={text!r} must look like <iteration>[-<last>]:<rank>")
    first, last, rank = match.groups()
    return int(first), int(last or first), int(rank)


@dataclass(frozen=True)
class FaultInjector(TrainerCallback):
    """The faults the environment asks for (see the module docstring), as a trainer callback."""

    nan_at: Optional[Tuple[int, int, int]] = None
    hang_at: Optional[Tuple[int, int, int]] = None
    save_sleep_s: float = 0.0
    write_sleep_s: float = 0.0

    @classmethod
    def from_env(cls) -> Optional["FaultInjector"]:
        """The injector the environment asks for; None where none of its variables is set."""
        injector = cls(_parse_spec(ENV_NAN_AT), _parse_spec(ENV_HANG_AT),
                       float(os.environ.get(ENV_SAVE_SLEEP, "0") or 0),
                       float(os.environ.get(ENV_WRITE_SLEEP, "0") or 0))
        return None if injector == cls() else injector

    @staticmethod
    def _hits(spec, iteration: int, rank: int) -> bool:
        return spec is not None and spec[0] <= iteration <= spec[1] and rank == spec[2]

    # ---- the trainer's callback points (train/callbacks.py) ---------------------------------

    def on_train_start(self, trainer) -> None:
        trainer.train_forward_step = self.wrap_forward_step(
            trainer.train_forward_step, lambda: trainer.state.iteration + 1)

    def on_step_start(self, trainer, iteration: int) -> None:
        import torch.distributed as dist

        self.maybe_hang(iteration, dist.get_rank(), trainer.monitor.group)

    def before_checkpoint_commit(self, iteration: int) -> None:
        if self.save_sleep_s > 0:
            time.sleep(self.save_sleep_s)

    def on_async_save(self, request):
        return self.slow_background_write(request)

    # ---- the faults ----------------------------------------------------------------------------

    def wrap_forward_step(self, forward_step, iteration: Callable[[], int]):
        """``forward_step`` whose loss is NaN where the NaN hook selects this rank and the
        current ``iteration()``; ``forward_step`` itself without the hook."""
        if self.nan_at is None:
            return forward_step
        import torch.distributed as dist

        rank = dist.get_rank()

        def poisoned_forward_step(data_iterator, model):
            output, loss_func = forward_step(data_iterator, model)

            def poisoned_loss(output_tensor):
                loss, logged = loss_func(output_tensor)
                if not self._hits(self.nan_at, iteration(), rank):
                    return loss, logged
                return loss * float("nan"), {k: v * float("nan") for k, v in logged.items()}
            return output, poisoned_loss
        return poisoned_forward_step

    def maybe_hang(self, iteration: int, rank: int, group) -> None:
        """Stop responding where the hang hook selects us, as a rank stuck in communication
        does (collectives out of step): wait up to an hour for a message from another rank
        that is never sent, on ``group`` (the trainer's ``RankMonitor``'s). Such a rank takes
        part in nothing else, and its wait ends, with an error, only when that rank's
        connection closes, i.e. once it has found the hang and stopped. (On the default group
        the wait would end when the other rank's collective times out, before it asks who is
        missing.) A rank stuck outside communication would wait for the launcher's SIGKILL
        instead: the pre-emption handler only sets a flag for a step boundary it never
        reaches."""
        if not self._hits(self.hang_at, iteration, rank):
            return
        import torch
        import torch.distributed as dist

        peer = 1 if rank == 0 else 0
        dist.irecv(torch.empty(1), src=peer, group=group).wait(
            timeout=datetime.timedelta(hours=1))

    def slow_background_write(self, request):
        """megatron's ``AsyncRequest`` whose background function first sleeps
        ``write_sleep_s`` (in the process megatron forks for it); ``request`` without it."""
        if self.write_sleep_s <= 0 or request.async_fn is None:
            return request
        return request._replace(async_fn=functools.partial(_sleep_then, self.write_sleep_s,
                                                           request.async_fn))


def _sleep_then(seconds: float, fn, *args, **kwargs):
    time.sleep(seconds)
    return fn(*args, **kwargs)


def callbacks_from_env() -> List[TrainerCallback]:
    """The trainer callbacks the environment's fault variables ask for (none where none is
    set)."""
    injector = FaultInjector.from_env()
    return [] if injector is None else [injector]
