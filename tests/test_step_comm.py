"""The TP collectives of a training step: known from the formula, measured only on request.

Two gloo ranks (TP=2) build the trainer on configs/debug.yaml for each mode (and boost in bf16
and with each recompute; boost and naive with tied embeddings) with
``logging.measure_comm: true`` and ``logging.log_interval: 2``:

* iteration 1 is an ordinary step: inside it (probed from the forward step) every entry point
  ``record_collectives`` would wrap is the original function, so no process-wide patch runs;
* iteration 2 is a log step: the probe sees the wrappers, and the bytes measured equal the
  formula's (``analysis/comm.py``, ``step_comm_bytes``; docs/design.md §5) exactly: both are
  integer byte counts of the same collectives.
"""

from __future__ import annotations

import pytest

from tests.rank_pool import distributed

CASES = {
    "full": ["parallel.mode=full"],
    "naive": ["parallel.mode=naive"],
    "boost": [],
    "boost bf16": ["training.precision=bf16"],
    "boost full recompute": ["training.recompute=full"],
    "boost lowrank recompute": ["training.recompute=lowrank"],
    # tied: boost's reduce-scatter of the partial embedding rows (and its all-gather backward);
    # naive's vocab-parallel ends carry the same collectives tied or not
    "boost tied": ["model.share_embeddings_and_output_weights=true"],
    "naive tied": ["parallel.mode=naive", "model.share_embeddings_and_output_weights=true"],
}


def _wrapped_entry_points():
    """Which of record_collectives' targets are currently replaced (by name)."""
    from megatron_boost.measure.collectives import _TARGETS

    return sorted(f"{owner.__name__}.{name}" for owner, name, _ in _TARGETS
                  if getattr(getattr(owner, name), "__name__", "") == "wrapped")


def _case(run_dir, overrides):
    from test_host_sync import close_trainer, trainer_for

    trainer = trainer_for(run_dir, ["parallel.tp=2", "logging.measure_comm=true",
                                    "logging.log_interval=2", *overrides], world_size=2)
    seen = []
    forward_step = trainer.train_forward_step

    def probing_forward_step(data_iterator, model):
        seen.append(_wrapped_entry_points())
        return forward_step(data_iterator, model)

    trainer.train_forward_step = probing_forward_step
    try:
        ordinary = trainer.train_step()
        wrapped_ordinary, seen[:] = list(seen), []
        logged = trainer.train_step()
    finally:
        close_trainer(trainer)
    return {"wrapped_ordinary": wrapped_ordinary, "wrapped_logged": list(seen),
            "ordinary": ordinary, "logged": logged}


def _worker(rank, world, run_dir):
    import sys

    sys.path.insert(0, "tests")
    return {name: _case(f"{run_dir}/{rank}/{i}", overrides)
            for i, (name, overrides) in enumerate(CASES.items())}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return distributed(_worker, 2, str(tmp_path_factory.mktemp("step_comm")),
                           timeout=600)


@pytest.mark.parametrize("case", list(CASES))
def test_no_process_wide_patch_during_an_ordinary_step(results, case):
    for rank_results in results:
        r = rank_results[case]
        assert r["wrapped_ordinary"] and not any(r["wrapped_ordinary"]), r["wrapped_ordinary"]
        assert "tp_comm_bytes_measured" not in r["ordinary"]
        # the probe does see the wrappers where a measurement was asked for
        assert all("torch.distributed.all_reduce" in w for w in r["wrapped_logged"])


@pytest.mark.parametrize("case", list(CASES))
def test_formula_equals_measured_step_collectives(results, case):
    for rank_results in results:
        r = rank_results[case]
        assert r["ordinary"]["tp_comm_bytes"] == r["logged"]["tp_comm_bytes"] > 0
        assert r["logged"]["tp_comm_bytes_measured"] == r["logged"]["tp_comm_bytes"], r["logged"]
