"""Everything the conversion tools use from the rest of megatron-boost, in one place.

The tools (export, import, generate) work on ONE process at TP = PP = 1: a
checkpoint of any layout is resharded by dist_checkpointing into that model
(``docs/design.md §8``), and a new checkpoint is written by the trainer's own save code, so it
loads into any layout. CPU mode with a gloo group of one process (``docs/design.md §9``) runs
megatron-core's code paths without a GPU. Evaluation runs in the launched layout instead
(torchrun, any TP / PP / DP): the checkpoint reshards into this rank's chunks and megatron's
forward-only pipeline schedule scores the micro-batches, as the trainer's validation does.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import tempfile
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import yaml

from megatron_boost.config.modes import TPMode
from megatron_boost.config.resolved import ResolvedRun, padded_vocab_size, resolve_run
from megatron_boost.config.run import RunConfig, load_run_config
from megatron_boost.data.datasets import build_tokenizer
from megatron_boost.model.init import sharded_params
from megatron_boost.train.build import build_run
from megatron_boost.train.checkpoint_guard import (check_tensor_shapes, read_common_state,
                                                   verify_manifest)
from megatron_boost.train.checkpointing import (TRACKER_FILE, check_format_version,
                                                find_checkpoint, save_checkpoint)
from megatron_boost.train.distributed import init_distributed, init_world_of_one, shutdown
from megatron_boost.train.resilience import process_group_timeout
from megatron_boost.train.state import TrainState
from megatron_boost.train.step import initialize_parallel, make_forward_step, run_schedule

__all__ = [
    "RunConfig", "load_run_config", "build_tokenizer", "padded_vocab_size", "TRACKER_FILE",
    "single_process", "resolve_checkpoint", "saved_run_config", "saved_vocab_rows",
    "build_single_model", "initialised_single_model", "global_weights", "load_weights",
    "set_weights", "logits",
    "save_weights_as_checkpoint", "is_lowrank", "load_chunk_weights",
    "launched_world", "launched_model", "forward_only_losses", "holds_the_loss",
]


def is_lowrank(cfg: RunConfig) -> bool:
    return TPMode.parse(cfg.parallel.mode).is_lowrank


@contextlib.contextmanager
def single_process(seed: int = 1234) -> Iterator[None]:
    """A gloo world of one process in CPU mode with megatron's groups at TP = PP = 1, unless a
    process group already exists (then that one is used as it is). On exit the world is closed
    and CPU mode is switched off again if this context switched it on (a caller in the same
    process, e.g. a test, finds the process as it was)."""
    import torch.distributed as dist

    from megatron_boost.runtime.cpu_mode import cpu_mode_left_as_found, use_cpu

    if dist.is_initialized():
        yield
        return
    with cpu_mode_left_as_found():
        use_cpu(force=True)
        try:
            init_world_of_one("gloo")
            initialize_parallel(1, 1, None, seed)
            yield
        finally:
            shutdown()  # megatron's groups and the process group


def resolve_checkpoint(path: str) -> Path:
    """A run's checkpoint folder (its latest iteration, by the tracker) or one iter_* folder,
    checked complete as the trainer checks it before reading (train/checkpoint_guard.py: every
    file against the manifest, so a half-written or damaged checkpoint is one error)."""
    ckpt = find_checkpoint(path) if Path(path).is_dir() else None
    if ckpt is None:
        raise ValueError(f"checkpoint '{path}' is neither a checkpoint folder with "
                         f"{TRACKER_FILE} nor an iter_* folder with metadata.json; give a run's "
                         f"checkpoints folder (e.g. runs/debug/checkpoints)")
    if not ckpt.is_dir():
        raise ValueError(f"checkpoint '{path}': {TRACKER_FILE} names {ckpt.name}, which does "
                         f"not exist (deleted or not yet written)")
    verify_manifest(ckpt)
    return ckpt


def saved_run_config(ckpt: Path, overrides: Sequence[str] = (),
                     world_size: Optional[int] = None) -> Tuple[RunConfig, dict]:
    """The run configuration saved in a checkpoint's common state (with ``overrides``,
    validated for ``world_size`` processes when given), and that state."""
    boost = read_common_state(ckpt)
    check_format_version(boost, ckpt)
    if "run_config" not in boost:
        raise ValueError(f"{ckpt} is not a megatron-boost checkpoint (no boost_state with the "
                         f"run config); export only checkpoints written by pretrain_lowrank.py")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.yaml"
        path.write_text(yaml.safe_dump(boost["run_config"]))
        return load_run_config(str(path), overrides, world_size), boost


def saved_vocab_rows(ckpt: Path) -> int:
    """Rows of the saved (padded) embedding table, from the checkpoint metadata."""
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(ckpt))
    return int(meta["embedding.word_embeddings.weight"].global_shape[0])


def single_process_config(cfg: RunConfig) -> RunConfig:
    """The same model at TP = PP = 1 in fp32 without recompute (for conversion and checks)."""
    cfg = copy.deepcopy(cfg)
    cfg.parallel = dataclasses.replace(cfg.parallel, tp=1, pp=1, vpp=None, dp=None,
                                       use_distributed_optimizer=False)
    cfg.training.recompute = None
    cfg.training.precision = "fp32"
    return cfg


def single_process_run(cfg: RunConfig, vocab_rows: int) -> ResolvedRun:
    """``cfg`` resolved at TP = PP = 1 in fp32 on this process, with ``vocab_rows`` embedding
    rows (a checkpoint's, or the importer's padding); no tokenizer is read."""
    return resolve_run(single_process_config(cfg), vocab_size=vocab_rows,
                       padded_vocab=vocab_rows)


def build_single_model(cfg: RunConfig, vocab_rows: int):
    """The model of ``cfg`` at TP = PP = 1 (one chunk), fp32, in eval mode, with the
    trainer's layout-independent initial weights of ``cfg``'s seed (``docs/design.md §8``)."""
    return build_run(single_process_run(cfg, vocab_rows), training=False).chunks[0]


def initialised_single_model(cfg: RunConfig, vocab_rows: int):
    """The TP = 1 model with the trainer's initial weights: the reference any layout's
    untrained checkpoint must reproduce (every built model starts from them)."""
    return build_single_model(cfg, vocab_rows)


def global_weights(model) -> Dict[str, torch.Tensor]:
    """Global checkpoint key -> parameter; at TP = PP = 1 every parameter is its global tensor."""
    return {key: param for key, _, _, param in sharded_params(model)}


def load_weights(model, ckpt: Path) -> None:
    """Load only the model's sharded state from a checkpoint of any layout (the optimizer
    part, regular or distributed, is not read)."""
    load_chunk_weights([model], ckpt)


def load_chunk_weights(chunks: List, ckpt: Path) -> None:
    """:func:`load_weights` for this rank's model chunks in any layout: dist_checkpointing
    finds every shard by its global key and reshards (``docs/design.md §8``)."""
    from megatron_boost.train.checkpointing import load_model_chunks

    sharded = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
    check_tensor_shapes(ckpt, sharded)
    load_model_chunks(ckpt, chunks)  # as the trainer loads (modules' extra state included)


def set_weights(model, weights: Dict[str, torch.Tensor]) -> None:
    """Copy global tensors into the TP = 1 model (every key must be present, shapes equal)."""
    params = global_weights(model)
    missing = sorted(set(params) - set(weights))
    if missing:
        raise ValueError(f"no source tensor for {missing[:3]} ({len(missing)} missing)")
    with torch.no_grad():
        for key, param in params.items():
            src = weights[key]
            if tuple(src.shape) != tuple(param.shape):
                raise ValueError(f"{key}: source shape {tuple(src.shape)} does not match the "
                                 f"model's {tuple(param.shape)}")
            param.copy_(src)


@torch.no_grad()
def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """[b, s] token ids -> [b, s, V] logits of the TP = 1 megatron model."""
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)  # [b, s]
    return model(tokens, positions, None).float()


def save_weights_as_checkpoint(cfg: RunConfig, weights: Dict[str, torch.Tensor],
                               vocab_rows: int, save_dir: str) -> str:
    """Write ``weights`` as iteration 0 of a trainer checkpoint (the trainer's own save code:
    model, fresh optimizer and scheduler state, run config), a start for a run in any layout
    with ``checkpoint.init_from=<save_dir>``."""
    built = build_run(single_process_run(cfg, vocab_rows))
    set_weights(built.chunks[0].module, weights)
    # The scheduler's settings are the configuration's; the trainer's configuration replaces
    # them on load anyway (override_opt_param_scheduler): only the step count, 0, is kept.
    return save_checkpoint(save_dir, TrainState(), built.chunks, built.optimizer,
                           built.scheduler, cfg)


# ---------------------------------------------------------------------------------------------
# the launched layout (evaluation)
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def launched_world(cfg: RunConfig, device: str) -> Iterator[torch.device]:
    """torchrun's process group (without torchrun: a world of this process) with megatron's
    groups in ``cfg``'s layout, validated for this world size; yields the batch device."""
    init_distributed(device, process_group_timeout(cfg.parallel.timeout_minutes))
    try:
        initialize_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp,
                            cfg.training.seed)
        yield (torch.device("cuda", torch.cuda.current_device()) if device == "cuda"
               else torch.device("cpu"))
    finally:
        shutdown()  # megatron's groups and the process group


def launched_model(cfg: RunConfig, ckpt: Path, device: torch.device) -> List:
    """This rank's model chunks of ``cfg``'s layout in fp32 and eval mode, holding the
    checkpoint's weights (resharded from whatever layout it was saved in)."""
    rows = saved_vocab_rows(ckpt)
    run = resolve_run(cfg, device.type, vocab_size=rows, padded_vocab=rows)
    chunks = build_run(run.with_precision("fp32"), training=False).chunks
    load_chunk_weights(chunks, ckpt)
    return chunks


@torch.no_grad()
def forward_only_losses(chunks: List, microbatches: List[dict], seq_length: int,
                        micro_batch_size: int) -> List[float]:
    """Mean token loss of every micro-batch (each a dict of [b, s] tokens, labels, loss_mask,
    position_ids), through the trainer's forward step and megatron's forward-only schedule;
    empty off the last pipeline stage."""
    iterators = [iter(microbatches) for _ in chunks]  # every virtual chunk reads the same data
    losses = run_schedule(make_forward_step(next), iterators, chunks, len(microbatches),
                          seq_length, micro_batch_size, forward_only=True)
    return [float(loss["lm loss"]) for loss in losses]


def holds_the_loss() -> bool:
    """One rank per data-parallel replica reports its loss: the last pipeline stage holds it,
    every tensor-parallel rank there the same value (vocab-parallel cross entropy)."""
    from megatron.core import parallel_state as ps

    return (ps.is_pipeline_last_stage(ignore_virtual=True)
            and ps.get_tensor_model_parallel_rank() == 0)
