"""Ready for CUDA graphs (``training.cuda_graph_impl: local``, docs/design.md §7): what a graph
replay needs of the layers, checked on the CPU.

A per-layer CUDA graph captures a layer's kernels once and replays them; a replay runs no
Python. So the captured region, a decoder layer's forward and backward, must (1) request no
host synchronisation (capture fails on one) and (2) read or write no Python state that changes
from call to call, since a replay would freeze it at its captured value. Low-rank recompute's
log of the forward all-reduces (``parallel/recompute.py``) is such state, which is why the
validation refuses graphs with it (tests/test_bad_input.py's cuda_graph rows).

One gloo job at TP=2 (the layers' collectives run) builds a tiny boost and a tiny naive model
with the settings graphs run with (no recompute), and over one forward-backward of the
micro-batches after a warm-up one, for each:

* counts the host synchronisations (:class:`~megatron_boost.testing.host_sync.HostSyncCounter`;
  it does not see inside autograd's backward engine);
* counts the recompute logs (``ForwardReductions``) created: none may exist; with
  ``training.recompute=lowrank`` the same count is positive, so the count does see a log;
* compares every module's plain Python attributes (not tensors, parameters or sub-modules)
  before and after: a forward that keeps per-call Python state changes one.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from tests.rank_pool import distributed

SEQ, MBS, MICROBATCHES = 16, 2, 2
MODES = ("boost", "naive")


def _batches(vocab: int, seed: int):
    """The micro-batches of the steps, over and over: three steps' worth of random tokens."""
    from megatron_boost.data.synthetic import synthetic_microbatches

    return itertools.cycle(synthetic_microbatches(vocab, SEQ, MBS, 3 * MICROBATCHES * MBS, seed))


def _plain(value):
    """A comparable copy of an attribute: a tensor held in a container as its shape and dtype
    (its values are the kernels' business, which a replay updates); an object compared by
    identity as its repr."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *map(_plain, value))
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if type(value).__eq__ is object.__eq__:
        return repr(value)  # a copy would never equal the original
    try:
        return copy.deepcopy(value)
    except Exception:  # process groups and the like: held, never changed per call
        return repr(value)


def _python_state(model: torch.nn.Module) -> dict:
    """(module name, attribute) -> value of every plain Python attribute of every module:
    what a graph replay would not update."""
    return {(name, key): _plain(value)
            for name, module in model.named_modules() for key, value in vars(module).items()
            # _parameters, _buffers, _modules, hooks: torch's own bookkeeping
            if not key.startswith("_") and not isinstance(value, (torch.Tensor, torch.nn.Module))}


def _changed(before: dict, after: dict) -> list:
    return sorted(f"{name or 'model'}.{key}" for name, key in before.keys() | after.keys()
                  if before.get((name, key)) != after.get((name, key)))


def _count_logs(monkeypatch_log: list):
    """Patch ForwardReductions.__init__ so that each log created is counted."""
    from megatron_boost.parallel import recompute

    original = recompute.ForwardReductions.__init__

    def counting(self, *args, **kwargs):
        monkeypatch_log.append(1)
        original(self, *args, **kwargs)
    recompute.ForwardReductions.__init__ = counting
    return lambda: setattr(recompute.ForwardReductions, "__init__", original)


def _one_mode(mode: str, recompute) -> dict:
    from megatron_boost.config.resolved import resolve_run
    from megatron_boost.config.run import load_run_config
    from megatron_boost.testing.host_sync import HostSyncCounter
    from megatron_boost.train.build import build_run
    from megatron_boost.train.step import run_schedule

    cfg = load_run_config("configs/debug.yaml", [
        "parallel.tp=2", f"parallel.mode={mode}", f"model.seq_length={SEQ}",
        f"training.recompute={recompute or 'null'}", "training.seed=1"])
    built = build_run(resolve_run(cfg, "cpu"))
    data = [_batches(built.run.padded_vocab_size, seed=2)]

    def forward_backward():
        return run_schedule(built.forward_step, data, built.chunks, MICROBATCHES, SEQ, MBS,
                            forward_only=False)

    forward_backward()  # warm-up: lazy initialisation (buffers, megatron's caches)
    before = _python_state(built.chunks[0])
    logs: list = []
    restore = _count_logs(logs)
    try:
        with HostSyncCounter() as syncs:
            forward_backward()
    finally:
        restore()
    return {"syncs": dict(syncs.counts), "logs": len(logs),
            "changed": _changed(before, _python_state(built.chunks[0]))}


def _worker(rank, world):
    from megatron.core import parallel_state

    from megatron_boost.train.step import initialize_parallel

    initialize_parallel(world, 1, None, seed=1)
    try:
        out = {mode: _one_mode(mode, None) for mode in MODES}
        out["boost_lowrank"] = _one_mode("boost", "lowrank")
        return out
    finally:
        parallel_state.destroy_model_parallel()


@pytest.fixture(scope="module")
def steps():
    return distributed(_worker, 2)


@pytest.mark.parametrize("mode", MODES)
def test_forward_backward_makes_no_host_sync(steps, mode):
    for rank, out in enumerate(steps):
        assert out[mode]["syncs"] == {}, (rank, out[mode]["syncs"])


@pytest.mark.parametrize("mode", MODES)
def test_layers_keep_no_per_call_python_state(steps, mode):
    for rank, out in enumerate(steps):
        assert out[mode]["logs"] == 0, (rank, "a recompute log was created")
        assert out[mode]["changed"] == [], (rank, out[mode]["changed"])


def test_the_log_count_sees_lowrank_recompute(steps):
    """The positive control of the log count: with low-rank recompute, logs exist."""
    assert all(out["boost_lowrank"]["logs"] > 0 for out in steps), steps
