"""Checkpoints with megatron.core.dist_checkpointing (torch_dist backend; docs/design.md §10.4).

``<save>/iter_0000010/`` holds one dist_checkpointing state dict: the model chunks' sharded
state (``model``, or ``model0``, ``model1`` ... with vpp; the ShardedTensor keys are global, so
checkpoints move between TP / PP / vpp layouts, docs/design.md §8), the optimizer's (distributed
optimizer: ``fully_reshardable``, also across DP, docs/design.md §10.5), a per-rank
``rng_state`` and, written once, the common ``boost_state``: the :class:`TrainState`, the
scheduler, the layout, the run configuration and the format version. It is written into
``iter_0000010.tmp/`` and committed by :class:`~megatron_boost.train.checkpoint_writer.
CheckpointWriter` (manifest, fsync, rename, then the tracker file), so the tracker always names
a complete checkpoint. Before anything is loaded, :func:`verify_checkpoint` checks the files,
the format, every tensor shape and every object (:mod:`megatron_boost.train.checkpoint_guard`).
Modules' extra state (Transformer Engine's FP8 metadata, saved as ShardedObjects) moves both
ways between runs with and without TE (docs/design.md §10.18).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.transformer.module import Float16Module
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from megatron_boost.compat import load_sharded
from megatron_boost.config.resume_contract import check_resume_contract
from megatron_boost.runtime.cpu_mode import is_cpu_mode
from megatron_boost.train.checkpoint_guard import (
    EXTRA_STATE_SUFFIX,
    TRACKER_FILE,
    check_sharded_objects,
    check_tensor_shapes,
    damaged_checkpoint_hint,
    iter_dir_name,
    newest_intact_before,
    read_common_state,
    read_tracker,
    verify_manifest,
    without_unsaved_extra_state,
)
from megatron_boost.train.checkpoint_writer import CheckpointWriter
from megatron_boost.train.megatron_fixes import finish_optimizer_load, prepare_optimizer_load
from megatron_boost.train.state import TrainState

__all__ = ["TRACKER_FILE", "CHECKPOINT_FORMAT_VERSION", "Resumed", "checkpoint_state_dict",
           "save_checkpoint", "find_checkpoint", "verify_checkpoint", "load_checkpoint",
           "load_weights", "check_format_version", "load_model_state", "load_model_chunks"]

#: Version of the checkpoint content; a checkpoint of another version is refused on load.
CHECKPOINT_FORMAT_VERSION = 1


@dataclass
class Resumed:
    """What a load restored: the training position, the layout the checkpoint was saved in,
    and whether the RNG states were restored (same layout only)."""

    state: TrainState
    saved_layout: dict
    rng_restored: bool


def _model_keys(n_chunks: int) -> List[str]:
    return ["model"] if n_chunks == 1 else [f"model{i}" for i in range(n_chunks)]


def _model_sharded_state_dict(ddp_chunks, loading: Optional[Path] = None) -> dict:
    """The model chunks' sharded state; for ``loading`` a checkpoint, less the modules' extra
    state it has none of (:func:`without_unsaved_extra_state`)."""
    # DDP has no sharded_state_dict: use the wrapped module's (Float16Module delegates).
    sd = {key: chunk.module.sharded_state_dict()
          for key, chunk in zip(_model_keys(len(ddp_chunks)), ddp_chunks)}
    return sd if loading is None else without_unsaved_extra_state(sd, loading)


def _optimizer_sharded_state_dict(optimizer, model_sd: dict, distributed: bool,
                                  is_loading: bool) -> dict:
    # The default 'fully_sharded_model_space' fails on load ("flattened_range is not
    # supported"); 'fully_reshardable' gathers the state in model space on DP rank 0 at save
    # and reshards it on load, across DP, TP and PP changes (docs/design.md §10.5).
    metadata = {"distrib_optim_sharding_type": "fully_reshardable"} if distributed else {}
    return optimizer.sharded_state_dict(dict(model_sd), is_loading=is_loading,
                                        metadata=metadata)


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available() and not is_cpu_mode():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _layout() -> dict:
    return {"tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "vpp": ps.get_virtual_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size()}


def _rng_sharded_object(state):
    lay = _layout()
    return ShardedObject(
        "rng_state", state, (lay["pp"], lay["tp"], lay["dp"]),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
         ps.get_data_parallel_rank()), replica_id=0)


def checkpoint_state_dict(state: TrainState, ddp_chunks, optimizer, scheduler,
                          run_cfg) -> dict:
    """The sharded state dict a checkpoint of ``state.iteration`` saves (see the module
    docstring); :class:`~megatron_boost.train.checkpoint_writer.CheckpointWriter` writes it."""
    distributed = run_cfg.parallel.use_distributed_optimizer
    sd = _model_sharded_state_dict(ddp_chunks)
    sd["optimizer"] = _optimizer_sharded_state_dict(optimizer, sd, distributed, False)
    sd["rng_state"] = _rng_sharded_object(_rng_state())
    sd["boost_state"] = {
        "format_version": CHECKPOINT_FORMAT_VERSION,
        **state.state_dict(),
        "opt_param_scheduler": scheduler.state_dict(),
        "layout": _layout(),
        "mode": str(run_cfg.parallel.mode),
        "use_distributed_optimizer": bool(distributed),
        "run_config": dataclasses.asdict(run_cfg),
    }
    return sd


def save_checkpoint(save_dir: str, state: TrainState, ddp_chunks, optimizer, scheduler,
                    run_cfg) -> str:
    """Save and commit a checkpoint of ``state.iteration`` now (no background write, no
    pruning), for callers outside the training loop; returns its directory."""
    sd = checkpoint_state_dict(state, ddp_chunks, optimizer, scheduler, run_cfg)
    CheckpointWriter(save_dir, async_save=False, keep_last=None).save(sd, state.iteration)
    return str(Path(save_dir) / iter_dir_name(state.iteration))


def find_checkpoint(load: Optional[str]) -> Optional[Path]:
    """The checkpoint directory to resume from: ``load`` itself if it is a checkpoint
    (``iter_XXXXXXX``, has metadata.json), else the iteration named by its tracker file;
    None if there is none. A bad tracker is a ``ValueError`` (:func:`read_tracker`)."""
    if not load:
        return None
    p = Path(load)
    if (p / "metadata.json").is_file():
        return p
    iteration = read_tracker(p)
    return None if iteration is None else p / iter_dir_name(iteration)


def check_format_version(saved: dict, ckpt_dir) -> None:
    """Refuse a checkpoint whose ``boost_state`` has another format version."""
    version = saved.get("format_version")
    if version != CHECKPOINT_FORMAT_VERSION:
        raise ValueError(f"checkpoint {ckpt_dir} has format version {version}; this "
                         f"megatron-boost reads format version {CHECKPOINT_FORMAT_VERSION}")




def verify_manifest_shared(ckpt_dir: Path) -> None:
    """:func:`verify_manifest` split over the ranks (each checks its own share of the files,
    ``in_share``), then agreed: every rank raises the first rank's error, so none goes on to
    read while another stops."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        verify_manifest(ckpt_dir)
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    error = None
    try:
        verify_manifest(ckpt_dir, rank, world)
    except ValueError as err:
        error = str(err)
    errors = [None] * world
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        raise ValueError(first)


def _agreed_damage_hint(ckpt_dir: Path) -> str:
    """:func:`damaged_checkpoint_hint`, the older checkpoints verified by rank 0 only and
    its finding given to every rank (all raise the same line)."""
    distributed = dist.is_available() and dist.is_initialized()
    found = [None]
    if not distributed or dist.get_rank() == 0:
        found = [newest_intact_before(ckpt_dir)]
    if distributed and dist.get_world_size() > 1:
        dist.broadcast_object_list(found, src=0)
    return damaged_checkpoint_hint(ckpt_dir, found[0])


def verify_checkpoint(ckpt_dir: Path, ddp_chunks, run_cfg, weights_only: bool = False) -> dict:
    """Every check that can fail before a tensor is read: files against the manifest, the
    common state (its format), each model tensor's global shape, every object, then the
    run config against the checkpoint's: the resume contract (config/resume_contract.py; for
    ``weights_only``, checkpoint.init_from, only the keys the weights' function depends on).
    Returns the checkpoint's ``boost_state``."""
    try:
        verify_manifest_shared(ckpt_dir)
        saved = read_common_state(ckpt_dir)
    except ValueError as err:  # damaged: say what the user can resume from instead
        raise ValueError(f"{err}; {_agreed_damage_hint(ckpt_dir)}") from None
    check_format_version(saved, ckpt_dir)
    model_sd = _model_sharded_state_dict(ddp_chunks)
    saved_cfg, current_cfg = saved.get("run_config", {}), dataclasses.asdict(run_cfg)
    check_tensor_shapes(ckpt_dir, model_sd, saved_cfg, current_cfg)
    check_sharded_objects(ckpt_dir, model_sd)
    check_resume_contract(ckpt_dir, saved_cfg, current_cfg, weights_only=weights_only,
                          load_optim=not run_cfg.checkpoint.no_load_optim)
    return saved


def load_model_state(module: torch.nn.Module, state_dict: dict) -> None:
    """``module.load_state_dict`` that accepts exactly the missing ``*._extra_state`` keys
    (modules' extra state, e.g. Transformer Engine's FP8 metadata: not saved for TE's core
    attention, absent from a checkpoint saved without TE), as megatron's own loader does, and
    raises ``RuntimeError`` on any other missing or on any unexpected key."""
    if isinstance(module, Float16Module):  # its load_state_dict delegates and returns None
        module = module.module
    result = module.load_state_dict(state_dict, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith(EXTRA_STATE_SUFFIX)]
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"the checkpoint does not match the model: missing keys {missing[:5]} "
            f"({len(missing)} in all), unexpected keys {result.unexpected_keys[:5]} "
            f"({len(result.unexpected_keys)} in all)")


def _set_model_weights(ddp_chunks, loaded: dict) -> None:
    for key, chunk in zip(_model_keys(len(ddp_chunks)), ddp_chunks):
        load_model_state(chunk.module, loaded[key])


def load_model_chunks(ckpt_dir: Path, chunks) -> None:
    """The model state of a checkpoint into model chunks (not DDP-wrapped; any layout), as the
    trainer loads it: the conversion tools' load."""
    sd = without_unsaved_extra_state(
        {key: chunk.sharded_state_dict() for key, chunk in zip(_model_keys(len(chunks)), chunks)},
        ckpt_dir)
    loaded = load_sharded(sd, str(ckpt_dir))
    for key, chunk in zip(_model_keys(len(chunks)), chunks):
        load_model_state(chunk, loaded[key])


def load_weights(ckpt_dir: Path, ddp_chunks, optimizer) -> None:
    """Only the model weights of a checkpoint (verified by :func:`verify_checkpoint` with
    ``weights_only``), into any layout: ``checkpoint.init_from``. The optimizer state, the
    schedule, the iteration and the RNG stay those of a fresh start."""
    loaded = load_sharded(_model_sharded_state_dict(ddp_chunks, loading=ckpt_dir), str(ckpt_dir))
    _set_model_weights(ddp_chunks, loaded)
    optimizer.reload_model_params()  # main (fp32) params from the loaded weights


def load_checkpoint(ckpt_dir: Path, saved: dict, ddp_chunks, optimizer, scheduler,
                    run_cfg) -> Resumed:
    """Load a checkpoint (verified by :func:`verify_checkpoint`, whose ``saved`` state it
    takes) into this (possibly different)
    layout. The model and optimizer state reshard to any TP / PP / vpp (and, with the
    distributed optimizer, DP) layout; ``checkpoint.no_load_optim`` keeps a fresh optimizer
    state. The RNG states load only into the same layout (else the fresh seeding is kept)."""
    distributed = run_cfg.parallel.use_distributed_optimizer
    load_optim = not run_cfg.checkpoint.no_load_optim
    sd = _model_sharded_state_dict(ddp_chunks, loading=ckpt_dir)
    if load_optim:
        prepare_optimizer_load(optimizer, distributed)
        sd["optimizer"] = _optimizer_sharded_state_dict(optimizer, sd, distributed, True)
    same_layout = saved.get("layout") == _layout()
    if same_layout:
        sd["rng_state"] = _rng_sharded_object(None)
    loaded = load_sharded(sd, str(ckpt_dir))
    _set_model_weights(ddp_chunks, loaded)
    if load_optim:
        optimizer.load_state_dict(loaded["optimizer"])
        finish_optimizer_load(optimizer)
    else:  # every MegatronOptimizer has it (abstract in the base class, 0.16 to 0.19)
        optimizer.reload_model_params()  # main (fp32) params from the loaded weights
    scheduler.load_state_dict(saved["opt_param_scheduler"])
    if same_layout and loaded.get("rng_state") is not None:
        _set_rng_state(loaded["rng_state"])
    return Resumed(TrainState.from_state_dict(saved), saved.get("layout", {}), same_layout)
