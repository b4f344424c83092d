"""Host synchronisations per training step: a constant, not one per parameter or micro-batch.

One gloo worker builds the debug model twice, once with 1 layer and 1 micro-batch per step
and once with 3 layers and 4 micro-batches (so roughly 3x the parameters and 4x the
micro-batches), runs one warm-up step and counts the host synchronisations of the next
(:class:`~megatron_boost.testing.host_sync.HostSyncCounter`). The counts must be equal and
small. The same worker then does the same for the trainer's whole iteration. The counter
itself is checked first on known code.
"""

from __future__ import annotations

import time

import pytest
import torch

from megatron_boost.testing.host_sync import HostSyncCounter
from tests.rank_pool import distributed

SEQ, MBS = 16, 2
MAX_SYNCS_PER_STEP = 4


def test_counter_counts_each_kind(monkeypatch):
    # A CPU build of torch raises on synchronize; CPU mode makes it a no-op the same way.
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    t = torch.arange(4.0)
    with HostSyncCounter() as syncs:
        t.sum().item()
        float(t[0])
        t.tolist()
        t.cpu()
        bool(t[1] > 0)
        torch.cuda.synchronize()
        t * 2  # not a sync
    assert dict(syncs.counts) == {"item": 1, "float": 1, "tolist": 1, "cpu": 1, "bool": 1,
                                  "cuda.synchronize": 1}
    assert torch.cuda.synchronize is not syncs._counting_synchronize  # restored on exit


def _batches(vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    while True:
        tokens = torch.randint(0, vocab, (MBS, SEQ + 1), generator=gen)
        yield {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
               "loss_mask": torch.ones(MBS, SEQ),
               "position_ids": torch.arange(SEQ).expand(MBS, SEQ)}


def _step_syncs(num_layers, num_microbatches):
    from megatron_boost.config.resolved import resolve_run
    from megatron_boost.config.run import load_run_config
    from megatron_boost.train.build import build_run
    from megatron_boost.train.step import train_step

    cfg = load_run_config("configs/debug.yaml", [f"model.num_layers={num_layers}",
                                                 f"model.seq_length={SEQ}", "training.seed=1"])
    built = build_run(resolve_run(cfg, "cpu"))
    data = [_batches(built.run.padded_vocab_size, seed=2)]

    def step():
        return train_step(built.forward_step, data, built.chunks, built.optimizer,
                          num_microbatches, SEQ, MBS)

    step()  # warm-up: lazy initialisation (optimizer state, buffers)
    with HostSyncCounter() as syncs:
        step()
    return dict(syncs.counts)


def _step_worker():
    from megatron.core import parallel_state

    from megatron_boost.train.step import initialize_parallel

    initialize_parallel(1, 1, None, seed=1)
    try:
        return {"small": _step_syncs(1, 1), "large": _step_syncs(3, 4)}
    finally:
        parallel_state.destroy_model_parallel()  # the trainer's counts run next


def _worker(rank, world, run_dir):
    """Both counts in one process (a process start costs seconds of imports): the bare train
    step's, then the trainer iteration's. Each count follows its own warm-up step."""
    return {"step": _step_worker(), "trainer": _trainer_worker(rank, world, run_dir)}


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    return distributed(_worker, 1, str(tmp_path_factory.mktemp("host_sync")))[0]


def test_host_syncs_per_step_do_not_grow_with_parameters_or_micro_batches(counts):
    counts = counts["step"]
    assert counts["small"] == counts["large"], counts
    assert sum(counts["large"].values()) <= MAX_SYNCS_PER_STEP, counts


# ---- the trainer's whole iteration ---------------------------------------------------------

#: An ordinary iteration reads the host three times: once for the step's one agreement
#: all-reduce (finite flag, pre-emption flag and loss, megatron_boost/train/resilience.py), and
#: twice inside megatron's gradient norm without apex (its local L2-norm fallback's float(),
#: then the norm's .item()).
MAX_TRAINER_SYNCS_PER_STEP = 3


def trainer_for(run_dir, overrides, world_size=1):
    """A Trainer on configs/debug.yaml in this process (the process group must exist)."""
    from megatron_boost.config.run import load_run_config
    from megatron_boost.train.metrics import Progress
    from megatron_boost.train.trainer import Trainer

    cfg = load_run_config("configs/debug.yaml",
                          [f"logging.run_dir={run_dir}", "logging.tensorboard=false",
                           "training.eval_iters=0", "training.train_iters=20", *overrides],
                          world_size)
    trainer = Trainer(cfg, "cpu")
    # train() starts the elapsed-time / ETA clock with its loop; these tests call iteration()
    trainer.progress = Progress(time.perf_counter(), 0, 0, trainer.train_iters)
    return trainer


def close_trainer(trainer) -> None:
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator

    trainer.metrics.close()
    trainer.writer.close()
    destroy_num_microbatches_calculator()
    parallel_state.destroy_model_parallel()


def _trainer_syncs(run_dir, num_layers, num_microbatches):
    """Host syncs of one ordinary iteration (train step, log decision, skip budget, checkpoint
    and exit decision) and of one log iteration, after a warm-up iteration."""
    trainer = trainer_for(run_dir, [f"model.num_layers={num_layers}",
                                    "training.micro_batch_size=2",
                                    f"training.global_batch_size={2 * num_microbatches}",
                                    "logging.log_interval=3"])
    # CPU mode makes torch.cuda.synchronize a no-op; as "cuda" the trainer calls it where it
    # would on a GPU, so the counter sees those calls.
    trainer.device = "cuda"
    try:
        assert trainer.num_microbatches == num_microbatches
        # The step's plain forward step, and no callback anywhere (none was given)
        hooks = {"callbacks": trainer.callbacks, "writer_callbacks": trainer.writer.callbacks,
                 "plain_forward_step": trainer.train_forward_step == trainer.forward_step}
        trainer.iteration()  # warm-up: lazy initialisation (optimizer state, buffers)
        with HostSyncCounter() as ordinary:
            trainer.iteration()  # iteration 2: no log record, no save
        with HostSyncCounter() as logged:
            trainer.iteration()  # iteration 3: a log record
    finally:
        close_trainer(trainer)
    return {"ordinary": dict(ordinary.counts), "logged": dict(logged.counts), "hooks": hooks}


def _trainer_worker(rank, world, run_dir):
    return {"small": _trainer_syncs(f"{run_dir}/small", 1, 1),
            "large": _trainer_syncs(f"{run_dir}/large", 3, 4)}


def test_trainer_iteration_host_syncs_do_not_grow_with_parameters_or_micro_batches(counts):
    counts = counts["trainer"]
    small, large = counts["small"], counts["large"]
    assert small["ordinary"] == large["ordinary"], counts
    assert sum(large["ordinary"].values()) <= MAX_TRAINER_SYNCS_PER_STEP, counts
    assert "cuda.synchronize" not in large["ordinary"], counts  # only at log iterations
    assert small["logged"] == large["logged"], counts
    assert large["logged"].get("cuda.synchronize") == 1, counts


def test_trainer_without_callbacks_calls_none_in_its_step(counts):
    """Callbacks (train/callbacks.py; the tests' fault injection is one) exist only where the
    entry point was given some; otherwise the trainer and its writer hold none and the step
    runs the plain forward step."""
    for built in counts["trainer"].values():
        assert built["hooks"] == {"callbacks": (), "writer_callbacks": (),
                                  "plain_forward_step": True}, built["hooks"]
