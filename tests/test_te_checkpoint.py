"""Module state megatron saves as ShardedObjects (Transformer Engine's ``_extra_state``) in
checkpoints of every mode and layout (docs/design.md §10.18), with the CPU stand-ins of
tests/te_standin.py in every slot TE fills:

* saving at TP=2 in each mode: naive's decoder runs on a one-rank TP group, so without the
  replica numbering of model/gpt.py every TP rank claims the extra state and megatron refuses
  to save ("Duplicate ShardedObject keys");
* loading across {stand-in, plain} x {TP=1, TP=2}, both ways: a checkpoint without the extra
  state into a model with it (megatron fails on the missing object without
  ``without_unsaved_extra_state``), and the reverse; the extra state saved comes back;
* any other missing object stays an error naming it;
* a naive TP=2 run with the stand-ins trains, saves, resumes and exports.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

from tests.rank_pool import distributed, pool
from tests.te_standin import standin_modules, te_standins
from tests.test_training import DEBUG, ROOT, _env

pytestmark = pytest.mark.compat

MODEL = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=8,
             num_query_groups=4, vocab_size=100, attn_rank=8, mlp_rank=8)
VARIANTS = ("standin", "plain")


def _build(mode: str, tp: int, standin: bool, seed: int):
    from megatron_boost.config.layout import Layout
    from megatron_boost.testing.verification import LayoutSpec, build_layout

    with te_standins() if standin else contextlib.nullcontext():
        cfg, built, _ = build_layout(LayoutSpec(layout=Layout(mode=mode, tp=tp),
                                                model=dict(MODEL), seed=seed))
    return cfg, built


def _model(built):
    return built.chunks[0].module


def _save(mode: str, variant: str, directory: Path) -> dict:
    """A TP=2 checkpoint of ``mode``; each stand-in's extra state names its module."""
    from megatron.core import parallel_state

    from megatron_boost.train.checkpointing import save_checkpoint
    from megatron_boost.train.state import TrainState

    cfg, built = _build(mode, 2, variant == "standin", seed=1)
    for name, module in standin_modules(_model(built)).items():
        module.te_state = {"saved_by": name}
    save_checkpoint(str(directory), TrainState(iteration=1), built.chunks, built.optimizer,
                    built.scheduler, cfg)
    params = {n: p.detach().clone() for n, p in _model(built).named_parameters()}
    parallel_state.destroy_model_parallel()
    return params


def _load(mode: str, variant: str, tp: int, ckpt: Path) -> dict:
    """Load ``ckpt`` as the trainer does into a model of ``variant`` at ``tp`` (other seed)."""
    from megatron.core import parallel_state

    from megatron_boost.train.checkpointing import load_checkpoint, verify_checkpoint

    cfg, built = _build(mode, tp, variant == "standin", seed=2)
    cfg.checkpoint.no_load_optim = True  # no step was taken: the optimizer has no state yet
    saved = verify_checkpoint(ckpt, built.chunks, cfg)
    load_checkpoint(ckpt, saved, built.chunks, built.optimizer, built.scheduler, cfg)
    model = _model(built)
    out = {"states": {n: (m.te_state, m.checkpointed)
                      for n, m in standin_modules(model).items()},
           "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    parallel_state.destroy_model_parallel()
    return out


def _missing_objects_named(mode: str, ckpt: Path) -> list:
    """The errors of the pre-load check for two objects this checkpoint lacks: one that is no
    module's extra state, and extra state of a key the checkpoint has but not this shard of it
    (a third layer)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from megatron_boost.train.checkpoint_guard import check_sharded_objects

    cfg, built = _build(mode, 2, True, seed=1)
    sd = {"model": _model(built).sharded_state_dict()}
    key = next(sh.key for sh in sd["model"].values()
               if isinstance(sh, ShardedObject) and "layers" in sh.key)
    errors = []
    for extra in (ShardedObject("decoder.layers.router_state", b"", (2,), (0,), replica_id=0),
                  ShardedObject(key, b"", (3,), (2,), replica_id=0)):
        try:
            check_sharded_objects(ckpt, {**sd, "extra": extra})
        except ValueError as err:
            errors.append(str(err))
    parallel_state.destroy_model_parallel()
    return errors


def _save_and_load_everywhere(rank, world, mode, tmp):
    tmp = Path(tmp)
    saved = {v: _save(mode, v, tmp / v) for v in VARIANTS}
    loads = {(src, dst, tp): _load(mode, dst, tp, tmp / src / "iter_0000001")
             for src in VARIANTS for dst in VARIANTS for tp in (1, 2)}
    # naive's checkpoint holds its norms' extra state: the objects to be missed
    errors = _missing_objects_named(mode, tmp / "standin" / "iter_0000001") if (
        mode == "naive") else None
    return saved, loads, errors


@pytest.mark.parametrize("mode", ["naive", "full", "boost"])
def test_extra_state_saves_and_loads_across_backends_and_layouts(mode, tmp_path):
    per_rank = distributed(_save_and_load_everywhere, 2, mode, str(tmp_path), timeout=600)
    for rank, (saved, loads, errors) in enumerate(per_rank):
        if errors is not None:  # nothing else is tolerated: named before the load
            assert len(errors) == 2, errors
            assert "has no object 'decoder.layers.router_state/shard_0_2'" in errors[0]
            assert "_extra_state/shard_2_3'" in errors[1]
        for (src, dst, tp), got in loads.items():
            where = f"rank {rank}: {src} checkpoint -> {dst} model at TP={tp}"
            if dst == "standin":
                assert got["states"], where  # the stand-ins are in place
                for name, (state, checkpointed) in got["states"].items():
                    # saved by TP rank 0 (the replica megatron keeps), same module names in
                    # every layout; a checkpoint without extra state leaves the fresh one
                    want = {"saved_by": name} if src == "standin" and checkpointed else None
                    assert state == want, (where, name, state)
            if tp == 2:  # the same layout: every weight is the saved one
                for name, param in got["params"].items():
                    assert param.equal(saved[src][name]), (where, name)


# ------------------------------------------------------------------------------------------
# a naive TP=2 run with the stand-ins: trains, saves, resumes, exports
# ------------------------------------------------------------------------------------------


RUN = ["parallel.tp=2", "parallel.mode=naive", "checkpoint.save_interval=2",
       "optimizer.lr_decay_iters=8", "training.eval_interval=100", "logging.log_interval=1"]


def _standin_training(run_dir: Path, iters: int):
    """The trainer with the stand-ins installed in its rank processes."""
    proc = pool().run(2, ["--config", DEBUG, *RUN, f"training.train_iters={iters}",
                          f"logging.run_dir={run_dir}"],
                      env=_env(), cwd=str(ROOT), timeout=240,
                      target="tests.te_standin:pretrain_main")
    assert proc.returncode == 0, proc.stderr[-6000:]
    return proc


def _held_extra_state(ckpt: Path) -> set:
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    return {k for k in load_sharded_metadata(str(ckpt)) if "_extra_state" in k}


def test_naive_tp2_run_with_te_standins_saves_resumes_and_exports(tmp_path):
    from megatron_boost.cli.export_hf import main as export_main

    run_dir = tmp_path / "run"
    _standin_training(run_dir, 2)
    first = run_dir / "checkpoints" / "iter_0000002"
    held = _held_extra_state(first)
    # the norms' extra state of both layers (one object each, saved once) and the final norm's
    assert any("linear_qkv.layer_norm__extra_state" in k for k in held), held
    assert any("final_layernorm._extra_state" in k for k in held), held
    proc = _standin_training(run_dir, 4)  # resumes from its own checkpoint at iteration 2
    assert "resumed from" in proc.stdout
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "loss" in r][-2:] == [3, 4]
    with te_standins():  # exported by a process that has the TE modules too
        assert export_main([str(run_dir / "checkpoints"), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file()
