"""Code a run calls at its named points: the trainer's one extension point.

A :class:`TrainerCallback` subclass overrides the methods it needs (each is a no-op here) and
is handed to the entry point, ``megatron_boost.cli.pretrain.main(argv, callbacks=[...])``
(or :func:`megatron_boost.train.trainer.train`), e.g. by a script of one's own that the
launcher starts with ``--entry``. A run without callbacks calls nothing of them: the lists
are empty. The fault-tolerance tests install their faults this way
(``megatron_boost/testing/faults.py``).
"""

from __future__ import annotations

__all__ = ["TrainerCallback"]


class TrainerCallback:
    """The points of a run a callback is called at, on every rank."""

    def on_train_start(self, trainer) -> None:
        """Once, in :meth:`Trainer.train` before the first step: the model, optimizer, resumed
        state and data are set up. ``trainer.train_forward_step`` is the forward step of the
        training steps (evaluation uses ``trainer.forward_step``); a callback may wrap it."""

    def on_step_start(self, trainer, iteration: int) -> None:
        """Before the training step of ``iteration`` (1-based), once a finished background
        save has been committed."""

    def before_checkpoint_commit(self, iteration: int) -> None:
        """Once the shards of ``iteration``'s checkpoint are written and before they are
        committed (in the save itself when synchronous, in the finalization of the background
        write when asynchronous)."""

    def on_async_save(self, request):
        """megatron's ``AsyncRequest`` of an asynchronous save, before it is scheduled; returns
        the request to schedule (its ``async_fn`` runs in the process megatron forks for it)."""
        return request
