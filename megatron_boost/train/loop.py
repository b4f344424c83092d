"""The pretraining loop of megatron-boost (entry point: ``pretrain_lowrank.py``).

    torchrun --nproc_per_node=2 pretrain_lowrank.py --config configs/debug.yaml parallel.tp=2
    python pretrain_lowrank.py --config configs/debug.yaml        # one process, no torchrun

megatron-core has no training loop; this module is ours, built from megatron-core pieces
(``megatron_boost.train.step``): DDP, the megatron optimizer, ``OptimizerParamScheduler``,
the num-microbatches calculator, the pipeline schedules and ``dist_checkpointing``.

Run directory (``logging.run_dir``):

* ``metrics.jsonl``: one JSON object per logged iteration with ``iteration``, ``tokens``
  (consumed), ``loss`` (mean training loss over the log interval), ``lr``, ``grad_norm``,
  ``tokens_per_s``, ``tflops`` (achieved model TFLOP/s *per device*, see ``flops.py``),
  ``mfu`` (null without a known peak), ``tp_comm_bytes`` (bytes this rank handed to
  tensor-parallel collectives in the last step, forward and backward), ``peak_mem_bytes``;
  evaluation iterations add ``val_loss`` and ``val_ppl``. Written by global rank 0 (the loss is
  broadcast from the last pipeline stage). On resume, records after the resumed iteration
  are dropped so that the file describes one trajectory.
* ``tensorboard/``: the same scalars, when the ``tensorboard`` package is installed.
* ``checkpoints/`` (default ``checkpoint.save``): see below.
* ``config.yaml``: the resolved run configuration.

Checkpoints (megatron.core.dist_checkpointing, torch_dist backend): ``<save>/iter_0000010/``
every ``checkpoint.save_interval`` steps, at the end and on pre-emption, then
``<save>/latest_checkpointed_iteration.txt``, written last by rank 0 after all ranks finished
(so it always names a complete checkpoint). A run resumes automatically from the checkpoint
named there in ``checkpoint.load`` (default: the save directory); ``checkpoint.load`` may also
name one ``iter_XXXXXXX`` directory. Content: model (``model`` or ``model0``, ``model1``, ...
with vpp), optimizer, per-rank RNG states, and the common ``boost_state`` (iteration, consumed
samples, scheduler, layout, run config); see :func:`save_checkpoint`. The data position is the
consumed-samples count: :class:`ConsumedSamplesSampler` continues the global sample order.

Resharding (tested in tests/test_training.py and by hand): a checkpoint loads into any other
TP / PP / vpp / DP layout, with the optimizer state, for both the regular and the distributed
optimizer (``fully_reshardable``); the continued losses match the uninterrupted run (exactly
in the same layout, to float rounding across layouts). ``checkpoint.no_load_optim=true``
loads the weights, scheduler and data position only (fresh Adam moments). A checkpoint
saved with the distributed optimizer needs it on load too (or ``no_load_optim``).

megatron-core 0.16's distributed optimizer has three load defects without apex/TE
(MEGATRON_NOTES.md), handled here without editing megatron: its state must exist (with a
``step``) before ``sharded_state_dict(is_loading=True)`` (:func:`_init_optimizer_state`
creates zero moments and a step per parameter, no dummy update); ``KeyError: 'step'`` when
the loaded tensors are copied (:func:`_patch_dist_opt_step_keyerror`, an instance-level
wrapper); and ONE ``step`` tensor shared by all parameters after load, which Adam would
increment once per parameter (:func:`_unshare_optimizer_steps` gives each its own clone).

Learning rate: linear warmup over ``optimizer.warmup_iters`` then cosine decay to
``optimizer.min_lr`` at ``optimizer.lr_decay_iters`` (default: the training length). Iteration
k (1-based) runs with the scheduler at step k, so the first update uses lr/warmup (not 0) and
the last one min_lr. On resume the *configuration* wins for every schedule parameter
(``override_opt_param_scheduler``); only the step count comes from the checkpoint.

Pre-emption: SIGTERM or SIGUSR1 sets a flag; at the next step boundary all ranks agree (one
all-reduce of a flag per step), save a checkpoint, print
``pre-emption signal received, checkpoint saved at iteration N`` and exit with status
:data:`PREEMPT_EXIT_CODE` (0). Under Slurm, torchrun handles the same signal
(``PET_SIGNALS_TO_HANDLE`` in ``scripts/slurm/pretrain.sbatch``) and itself exits non-zero
after its ranks have finished, which is what makes the batch script requeue the job.

Errors: ``ValueError`` (configuration, data, layout) ends the process with one line,
``error: <message>`` on stderr and exit status 2 (set ``MBOOST_TRACEBACK=1`` for the traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import resource
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

__all__ = ["main", "train", "PREEMPT_EXIT_CODE", "save_checkpoint", "load_checkpoint",
           "find_checkpoint", "ConsumedSamplesSampler"]

#: Exit status after a pre-emption signal was handled and the checkpoint is complete.
PREEMPT_EXIT_CODE = 0
#: Exit status for configuration / usage errors (``error: ...`` on stderr).
CONFIG_ERROR_EXIT_CODE = 2

TRACKER_FILE = "latest_checkpointed_iteration.txt"
CHECKPOINT_FORMAT_VERSION = 1


# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------


def iter_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _print0(*args, **kwargs) -> None:
    if _rank() == 0:
        print(*args, **kwargs, flush=True)


def train_iterations(cfg) -> int:
    """The number of optimizer steps of a run: from ``training.train_tokens`` when it is set
    (it wins over ``train_iters``, whose default is not null), else ``training.train_iters``."""
    t = cfg.training
    tokens_per_iter = t.global_batch_size * cfg.model.seq_length
    if t.train_tokens is not None:
        if t.train_tokens <= 0:
            raise ValueError(f"training.train_tokens ({t.train_tokens}) must be positive")
        return max(1, math.ceil(t.train_tokens / tokens_per_iter))
    if t.train_iters is None or t.train_iters <= 0:
        raise ValueError("set training.train_iters (a positive number of steps) or "
                         "training.train_tokens (a token budget)")
    return int(t.train_iters)


def check_run_config(cfg, world_size: int) -> Dict[str, int]:
    """Everything about batch sizes and budget that can be checked before any process group
    exists. Returns dp, num_microbatches, train_iters, lr_decay_iters."""
    par, t, o = cfg.parallel, cfg.training, cfg.optimizer
    model_parallel = par.tp * par.pp
    if world_size % model_parallel:
        raise ValueError(
            f"world size ({world_size}) must be divisible by parallel.tp × parallel.pp "
            f"({par.tp} × {par.pp} = {model_parallel}); launch a multiple of {model_parallel} "
            f"processes (torchrun --nproc_per_node=...)")
    dp = world_size // model_parallel
    if par.dp is not None and par.dp != dp:
        raise ValueError(
            f"parallel.dp ({par.dp}) does not match the launch: world size {world_size} / "
            f"(tp {par.tp} × pp {par.pp}) = {dp}; set parallel.dp to null or {dp}")
    mbs, gbs = t.micro_batch_size, t.global_batch_size
    if mbs < 1 or gbs < 1:
        raise ValueError(f"training.micro_batch_size ({mbs}) and training.global_batch_size "
                         f"({gbs}) must be >= 1")
    if gbs % (mbs * dp):
        raise ValueError(
            f"training.global_batch_size ({gbs}) must be divisible by "
            f"training.micro_batch_size × data-parallel size ({mbs} × {dp} = {mbs * dp}); "
            f"global_batch_size = micro_batch_size × dp × num_microbatches")
    iters = train_iterations(cfg)
    decay = o.lr_decay_iters if o.lr_decay_iters is not None else iters
    if decay < 1:
        raise ValueError(f"optimizer.lr_decay_iters ({decay}) must be >= 1")
    if o.warmup_iters < 0 or o.warmup_iters >= decay:
        raise ValueError(
            f"optimizer.warmup_iters ({o.warmup_iters}) must be >= 0 and smaller than the "
            f"decay length ({decay} = optimizer.lr_decay_iters or the number of training "
            f"iterations)")
    if o.min_lr > o.lr:
        raise ValueError(f"optimizer.min_lr ({o.min_lr}) must not exceed optimizer.lr ({o.lr})")
    if t.eval_interval is not None and t.eval_interval < 1:
        raise ValueError(f"training.eval_interval ({t.eval_interval}) must be >= 1")
    if cfg.logging.log_interval < 1:
        raise ValueError(f"logging.log_interval ({cfg.logging.log_interval}) must be >= 1")
    if cfg.checkpoint.save_interval is not None and cfg.checkpoint.save_interval < 1:
        raise ValueError(f"checkpoint.save_interval ({cfg.checkpoint.save_interval}) must be "
                         f">= 1 or null")
    return {"dp": dp, "num_microbatches": gbs // (mbs * dp), "train_iters": iters,
            "lr_decay_iters": decay}


# ---------------------------------------------------------------------------------------------
# data: consumed-samples-aware sampling
# ---------------------------------------------------------------------------------------------


class ConsumedSamplesSampler:
    """Batch sampler in the spirit of megatron's ``MegatronPretrainingSampler``.

    The global sample stream is ``start, start+1, ...`` (indices of the already shuffled
    GPTDataset, modulo its length). It is consumed in micro-steps of ``micro_batch_size × dp``
    samples; data-parallel rank k takes the k-th ``micro_batch_size`` slice of each. So the
    global order does not depend on the layout, and resuming at ``consumed_samples`` continues
    exactly where the saved run stopped (for any DP size).
    """

    def __init__(self, dataset_len: int, start: int, micro_batch_size: int, dp_rank: int,
                 dp_size: int, stop: Optional[int] = None):
        if dataset_len <= 0:
            raise ValueError("the dataset is empty; check data.data_path / data.split")
        self.n, self.start, self.mbs = dataset_len, start, micro_batch_size
        self.dp_rank, self.dp_size, self.stop = dp_rank, dp_size, stop

    def __iter__(self):
        step = self.mbs * self.dp_size
        pos = self.start
        while self.stop is None or pos + step <= self.stop:
            first = pos + self.dp_rank * self.mbs
            yield [(first + i) % self.n for i in range(self.mbs)]
            pos += step

    def __len__(self):  # pragma: no cover - DataLoader only needs it for len()
        if self.stop is None:
            return sys.maxsize
        return max(0, (self.stop - self.start) // (self.mbs * self.dp_size))


def _make_iterator(dataset, start: int, mbs: int, stop: Optional[int], num_workers: int):
    import torch
    from megatron.core import parallel_state

    sampler = ConsumedSamplesSampler(
        len(dataset), start, mbs, parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(), stop)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler,
                                         num_workers=num_workers, pin_memory=False)
    return iter(loader)


# ---------------------------------------------------------------------------------------------
# pre-emption signals
# ---------------------------------------------------------------------------------------------

_SIGNAL = {"received": None}


def _on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
    _SIGNAL["received"] = signum


def install_signal_handlers() -> None:
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, _on_signal)


def _signal_agreed(device) -> bool:
    """Whether any rank has received a pre-emption signal (one all-reduce over the world)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if _SIGNAL["received"] is not None else 0], dtype=torch.int32,
                        device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


# ---------------------------------------------------------------------------------------------
# checkpointing (megatron.core.dist_checkpointing, torch_dist backend)
# ---------------------------------------------------------------------------------------------


def _model_keys(n_chunks: int) -> List[str]:
    return ["model"] if n_chunks == 1 else [f"model{i}" for i in range(n_chunks)]


def _model_sharded_state_dict(ddp_chunks) -> dict:
    # DDP has no sharded_state_dict: use the wrapped module's (Float16Module delegates).
    # ShardedTensor keys are global (layer numbers offset per stage/chunk), so the top-level
    # key only structures the dict; checkpoints move between vpp settings.
    sd = {key: chunk.module.sharded_state_dict()
          for key, chunk in zip(_model_keys(len(ddp_chunks)), ddp_chunks)}
    return sd


def _optim_metadata(use_distributed_optimizer: bool) -> dict:
    # The default 'fully_sharded_model_space' fails on load ("flattened_range is not
    # supported"); 'fully_reshardable' gathers the state in model space on DP rank 0 at save
    # and reshards it on load, across DP, TP and PP changes.
    return {"distrib_optim_sharding_type": "fully_reshardable"} if use_distributed_optimizer \
        else {}


def _inner_torch_optimizers(optimizer) -> list:
    """The torch.optim optimizers inside a megatron (Chained/Distributed/...) optimizer."""
    chain = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    return [o.optimizer for o in chain if getattr(o, "optimizer", None) is not None]


def _init_optimizer_state(optimizer) -> None:
    """Create Adam state (zero moments, step 0, one step tensor per parameter) where none
    exists, as a real step would, without changing any parameter. megatron's distributed
    optimizer needs state, *with* a ``step``, before its checkpoint can be loaded."""
    import torch

    for opt in _inner_torch_optimizers(optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p.data)
                if "exp_avg_sq" not in state:
                    state["exp_avg_sq"] = torch.zeros_like(p.data)
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)


def _unshare_optimizer_steps(optimizer) -> Optional[float]:
    """Give every parameter's Adam state its own ``step`` tensor.

    megatron's DistributedOptimizer.load_state_dict (without apex/TE) assigns ONE tensor as
    ``step`` of every parameter; torch's Adam increments ``step`` in place per parameter, so
    after a resume the shared step would advance by the number of parameters per iteration
    and the bias correction (hence every update) would be wrong. Returns the step value."""
    value = None
    for opt in _inner_torch_optimizers(optimizer):
        for state in opt.state.values():
            if "step" in state:
                step = state["step"]
                state["step"] = step.detach().clone() if hasattr(step, "detach") else step
                value = float(state["step"])
    return value


def _patch_dist_opt_step_keyerror(optimizer) -> None:
    """megatron's DistributedOptimizer copies the loaded tensors over *every* key of the
    parameter's optimizer state, ``step`` included, but the fully_reshardable checkpoint holds
    only param/exp_avg/exp_avg_sq: ``KeyError: 'step'``. The step is restored separately (from
    the param groups), so keep it. Instance-level wrapper; megatron's code is not changed."""
    chain = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    for opt in chain:
        fn = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if fn is None or getattr(fn, "_mboost_patched", False):
            continue

        def patched(model_param, tensors, _fn=fn, _opt=opt):
            if "step" not in tensors:
                group_index, group_order = _opt.model_param_group_index_map[model_param]
                main_param = _opt.optimizer.param_groups[group_index]["params"][group_order]
                state = _opt.optimizer.state[main_param]
                if "step" in state:
                    tensors = {**tensors, "step": state["step"]}
            return _fn(model_param, tensors)

        patched._mboost_patched = True
        opt._set_main_param_and_optimizer_states = patched


def _rng_state() -> dict:
    import numpy as np
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state(),
             "tracker": get_cuda_rng_tracker().get_states()}
    from megatron_boost.runtime.cpu_mode import is_cpu_mode

    if torch.cuda.is_available() and not is_cpu_mode():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    import numpy as np
    import torch
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    get_cuda_rng_tracker().set_states(state["tracker"])


def _layout() -> dict:
    from megatron.core import parallel_state as ps

    return {"tp": ps.get_tensor_model_parallel_world_size(),
            "pp": ps.get_pipeline_model_parallel_world_size(),
            "vpp": ps.get_virtual_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size()}


def _rng_sharded_object(state):
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    lay = _layout()
    return ShardedObject(
        "rng_state", state, (lay["pp"], lay["tp"], lay["dp"]),
        (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank(),
         ps.get_data_parallel_rank()), replica_id=0)


def save_checkpoint(save_dir: str, iteration: int, ddp_chunks, optimizer, scheduler,
                    consumed_samples: int, run_cfg, use_distributed_optimizer: bool) -> str:
    """Save a complete checkpoint of this iteration under ``<save_dir>/iter_0000010/``.

    Content (one dist_checkpointing state dict): the model chunks' sharded state (``model``,
    or ``model0``, ``model1`` ... with virtual pipelining), the optimizer's sharded state
    (distributed optimizer: ``fully_reshardable``), a per-rank ``rng_state`` ShardedObject
    (python, numpy, torch, CUDA, and megatron's tensor-parallel RNG tracker) and, as common
    state written once, ``boost_state``: iteration, consumed samples, the scheduler state, the
    parallel layout and the run configuration. ``latest_checkpointed_iteration.txt`` is
    written LAST, by rank 0, after every rank has finished, so it always names a complete
    checkpoint."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    path = Path(save_dir) / iter_dir_name(iteration)
    if dist.get_rank() == 0:
        if path.exists():  # a partial save of an earlier, interrupted attempt
            shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    sd = _model_sharded_state_dict(ddp_chunks)
    model_sd = dict(sd)
    sd["optimizer"] = optimizer.sharded_state_dict(
        model_sd, is_loading=False, metadata=_optim_metadata(use_distributed_optimizer))
    sd["rng_state"] = _rng_sharded_object(_rng_state())
    sd["boost_state"] = {
        "format_version": CHECKPOINT_FORMAT_VERSION,
        "iteration": iteration,
        "consumed_samples": consumed_samples,
        "opt_param_scheduler": scheduler.state_dict(),
        "layout": _layout(),
        "mode": str(getattr(run_cfg.parallel, "mode")),
        "use_distributed_optimizer": bool(use_distributed_optimizer),
        "run_config": dataclasses.asdict(run_cfg),
    }
    dist_checkpointing.save(sd, str(path))
    dist.barrier()  # every rank's shards are on disk
    if dist.get_rank() == 0:
        tracker = Path(save_dir) / TRACKER_FILE
        tmp = tracker.with_suffix(".tmp")
        tmp.write_text(f"{iteration}\n")
        os.replace(tmp, tracker)
    dist.barrier()
    return str(path)


def find_checkpoint(load: Optional[str]) -> Optional[Path]:
    """The checkpoint directory to resume from: ``load`` itself if it is a checkpoint
    (``iter_XXXXXXX``, has metadata.json), else the iteration named by its
    ``latest_checkpointed_iteration.txt``; None if there is none."""
    if not load:
        return None
    p = Path(load)
    if (p / "metadata.json").is_file():
        return p
    tracker = p / TRACKER_FILE
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    try:
        iteration = int(text)
    except ValueError:
        raise ValueError(f"{tracker} does not hold an iteration number ({text!r})") from None
    ckpt = p / iter_dir_name(iteration)
    if not (ckpt / "metadata.json").is_file():
        raise ValueError(f"{tracker} names iteration {iteration} but {ckpt} is not a complete "
                         f"checkpoint")
    return ckpt


def load_checkpoint(ckpt_dir: Path, ddp_chunks, optimizer, scheduler,
                    use_distributed_optimizer: bool, no_load_optim: bool) -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` into this (possibly different)
    layout; returns its ``boost_state``. dist_checkpointing reshards the model to any TP/PP/vpp
    layout; the optimizer state reshards with it (regular optimizer: per-parameter sharded
    tensors; distributed optimizer: ``fully_reshardable``, also across DP). The RNG state only
    loads into the same layout (otherwise the freshly seeded one is kept)."""
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(ckpt_dir))
    boost = common.get("boost_state")
    if boost is None:
        raise ValueError(f"{ckpt_dir} is not a megatron-boost checkpoint (no boost_state)")
    sd = _model_sharded_state_dict(ddp_chunks)
    model_sd = dict(sd)
    load_optim = not no_load_optim
    if load_optim and bool(boost.get("use_distributed_optimizer")) != use_distributed_optimizer:
        raise ValueError(
            f"checkpoint {ckpt_dir} was saved with parallel.use_distributed_optimizer="
            f"{boost.get('use_distributed_optimizer')}; resume with the same setting or set "
            f"checkpoint.no_load_optim=true (weights only, fresh optimizer state)")
    if load_optim:
        _init_optimizer_state(optimizer)
        if use_distributed_optimizer:
            _patch_dist_opt_step_keyerror(optimizer)
        sd["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=True, metadata=_optim_metadata(use_distributed_optimizer))
    same_layout = boost.get("layout") == _layout()
    if same_layout:
        sd["rng_state"] = _rng_sharded_object(None)
    loaded = dist_checkpointing.load(sd, str(ckpt_dir))
    for key, chunk in zip(_model_keys(len(ddp_chunks)), ddp_chunks):
        chunk.module.load_state_dict(loaded[key], strict=True)
    if load_optim:
        optimizer.load_state_dict(loaded["optimizer"])
        _unshare_optimizer_steps(optimizer)
    elif hasattr(optimizer, "reload_model_params"):
        optimizer.reload_model_params()  # main (fp32) params from the loaded weights
    scheduler.load_state_dict(boost["opt_param_scheduler"])
    if same_layout and loaded.get("rng_state") is not None:
        _set_rng_state(loaded["rng_state"])
    boost["rng_restored"] = same_layout
    return boost


# ---------------------------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------------------------


class MetricsWriter:
    """metrics.jsonl (+ optional TensorBoard) on global rank 0."""

    def __init__(self, run_dir: Path, tensorboard: bool, resume_iteration: int):
        self.enabled = _rank() == 0
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        if not self.enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            # Keep only what precedes the resumed iteration: one trajectory per file.
            kept = []
            for line in self.path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("iteration", 0) <= resume_iteration:
                    kept.append(line)
            self.path.write_text("".join(k + "\n" for k in kept))
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
            except Exception:  # ImportError: the tensorboard package is optional
                print("notice: tensorboard is not installed; skipping TensorBoard logging "
                      "(pip install tensorboard, or set logging.tensorboard=false)", flush=True)

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self.tb is not None:
            step = record["iteration"]
            for key, value in record.items():
                if key != "iteration" and isinstance(value, (int, float)) and value is not None \
                        and not isinstance(value, bool):
                    self.tb.add_scalar(key, value, step)
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def _peak_memory_bytes(device: str) -> int:
    if device == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated())
    # Linux reports ru_maxrss in KiB (macOS in bytes).
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TB"


def _broadcast_from_last_stage(value: Optional[float], device) -> Optional[float]:
    """Hand a value that lives on the last pipeline stage to every rank of the pipeline
    group (so rank 0, on the first stage, can log it)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return value
    t = torch.tensor([float("nan") if value is None else value], dtype=torch.float64,
                     device=device)
    dist.broadcast(t, src=ps.get_pipeline_model_parallel_last_rank(),
                   group=ps.get_pipeline_model_parallel_group())
    out = float(t.item())
    return None if math.isnan(out) else out


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------


def _init_distributed(device: str):
    import datetime

    import torch
    import torch.distributed as dist

    if "RANK" not in os.environ:  # plain `python pretrain_lowrank.py`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        from megatron_boost.runtime.spawn import free_port

        os.environ.setdefault("MASTER_PORT", str(free_port()))
    if device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        backend = "nccl"
    else:
        backend = "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30))


def train(cfg) -> int:
    """Run (or resume) the training described by a :class:`~megatron_boost.config.run.RunConfig`.
    Returns the process exit status."""
    # ---- checks that need no process group (fail fast, identically on every rank) -------
    cfg.data.validate()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    plan = check_run_config(cfg, world_size)

    from megatron_boost.runtime.cpu_mode import maybe_use_cpu

    try:
        device = maybe_use_cpu(cfg.training.device)
    except RuntimeError as err:
        raise ValueError(str(err)) from None

    import numpy as np
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        get_num_microbatches,
        init_num_microbatches_calculator,
    )
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_boost.parallel import mappings as comm
    from megatron_boost.config.run import to_transformer_config
    from megatron_boost.data.datasets import build_gpt_datasets, build_tokenizer, get_batch
    from megatron_boost.analysis.flops import flops_per_token, peak_tflops
    from megatron_boost.model.gpt import padded_vocab_size
    from megatron_boost.train.step import (
        build_ddp_model,
        build_optimizer,
        eval_step,
        initialize_parallel,
        make_forward_step,
        train_step,
    )

    t_start = time.perf_counter()
    precision = cfg.training.precision
    if precision == "auto":
        precision = "bf16" if device == "cuda" else "fp32"
    params_dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    _init_distributed(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    install_signal_handlers()
    par, t, o = cfg.parallel, cfg.training, cfg.optimizer
    seed = t.seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    dp = initialize_parallel(par.tp, par.pp, par.vpp, seed)
    assert dp == plan["dp"], (dp, plan)
    init_num_microbatches_calculator(rank, None, t.global_batch_size, t.micro_batch_size, dp)
    num_microbatches = get_num_microbatches()
    train_iters, seq, mbs, gbs = plan["train_iters"], cfg.model.seq_length, \
        t.micro_batch_size, t.global_batch_size
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" \
        else torch.device("cpu")

    run_dir = Path(cfg.logging.run_dir)
    save_dir = cfg.checkpoint.save or str(run_dir / "checkpoints")
    load_dir = cfg.checkpoint.load or save_dir
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        import yaml

        (run_dir / "config.yaml").write_text(yaml.safe_dump(dataclasses.asdict(cfg),
                                                            sort_keys=False))
    try:
        # ---- tokenizer and model ---------------------------------------------------------
        data_cfg = dataclasses.replace(cfg.data)
        if data_cfg.mock and not data_cfg.tokenizer_model:
            data_cfg.mock_vocab_size = cfg.model.vocab_size
        tokenizer = build_tokenizer(data_cfg)
        vocab = int(tokenizer.vocab_size) if data_cfg.tokenizer_model else cfg.model.vocab_size
        padded_vocab = padded_vocab_size(vocab, par.tp)
        config = to_transformer_config(cfg, params_dtype)
        ddp_chunks = build_ddp_model(
            config, padded_vocab, seq, seed, overlap_grad_reduce=par.overlap_grad_reduce,
            use_distributed_optimizer=par.use_distributed_optimizer,
            rotary_base=cfg.model.rotary_base)
        optimizer = build_optimizer(
            config, ddp_chunks, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay,
            adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
            clip_grad=o.clip_grad, use_distributed_optimizer=par.use_distributed_optimizer)
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=o.lr, min_lr=o.min_lr,
            lr_warmup_steps=o.warmup_iters, lr_decay_steps=plan["lr_decay_iters"],
            lr_decay_style="cosine", start_wd=o.weight_decay, end_wd=o.weight_decay,
            wd_incr_steps=max(train_iters, 1), wd_incr_style="constant",
            use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=True)
        n_params_local = sum(p.numel() for c in ddp_chunks for p in c.module.parameters())
        _print0(f"megatron-boost: mode={par.mode} tp={par.tp} pp={par.pp} vpp={par.vpp} "
                f"dp={dp} world={world} device={device} precision={precision} | "
                f"layers={cfg.model.num_layers} d={cfg.model.hidden_size} "
                f"f={cfg.model.ffn_hidden_size} vocab={vocab} (padded {padded_vocab}) "
                f"seq={seq} | params on rank 0: {n_params_local / 1e6:.2f}M | "
                f"global batch {gbs} = micro {mbs} × dp {dp} × {num_microbatches} micro-batches"
                f" | {train_iters} iterations ({train_iters * gbs * seq:,} tokens)")

        # ---- resume --------------------------------------------------------------------
        iteration, consumed_samples = 0, 0
        ckpt = find_checkpoint(load_dir)
        if cfg.checkpoint.load and ckpt is None:
            raise ValueError(f"checkpoint.load '{cfg.checkpoint.load}' holds no checkpoint "
                             f"(no {TRACKER_FILE} and no metadata.json)")
        if ckpt is not None:
            t0 = time.perf_counter()
            boost = load_checkpoint(ckpt, ddp_chunks, optimizer, scheduler,
                                    par.use_distributed_optimizer, cfg.checkpoint.no_load_optim)
            iteration, consumed_samples = int(boost["iteration"]), int(boost["consumed_samples"])
            saved = boost.get("layout", {})
            _print0(f"resumed from {ckpt} at iteration {iteration} ({consumed_samples} samples "
                    f"consumed; saved layout tp={saved.get('tp')} pp={saved.get('pp')} "
                    f"vpp={saved.get('vpp')} dp={saved.get('dp')}; optimizer state "
                    f"{'not ' if cfg.checkpoint.no_load_optim else ''}loaded; rng "
                    f"{'restored' if boost['rng_restored'] else 'reseeded (layout changed)'}"
                    f") in {time.perf_counter() - t0:.1f}s")

        # ---- data ------------------------------------------------------------------------
        eval_iters = t.eval_iters or 0
        train_ds, valid_ds, _ = build_gpt_datasets(
            data_cfg, tokenizer, seq, seed, train_samples=train_iters * gbs,
            valid_samples=max(eval_iters, 1) * gbs, test_samples=None)
        if valid_ds is None or len(valid_ds) == 0:
            eval_iters = 0
        n_iter_streams = len(ddp_chunks)  # each virtual chunk draws the same micro-batches

        def train_iterators(start):
            return [_make_iterator(train_ds, start, mbs, None, data_cfg.num_workers)
                    for _ in range(n_iter_streams)]

        def batch_fn(data_iterator):
            batch = get_batch(data_iterator)
            return {k: v.to(dev, non_blocking=True) for k, v in batch.items()}

        forward_step = make_forward_step(batch_fn)
        data_iters = train_iterators(consumed_samples)

        def evaluate() -> Optional[float]:
            iters = [_make_iterator(valid_ds, 0, mbs, eval_iters * gbs, 0)
                     for _ in range(n_iter_streams)]
            losses = []
            for _ in range(eval_iters):
                loss = eval_step(forward_step, iters, ddp_chunks, num_microbatches, seq, mbs)
                losses.append(loss)
            local = None if losses[0] is None else sum(losses) / len(losses)
            return _broadcast_from_last_stage(local, dev)

        # ---- accounting ------------------------------------------------------------------
        fpt = flops_per_token(cfg, par.mode, vocab_size=padded_vocab)
        peak = peak_tflops(cfg.logging.peak_tflops, device)
        metrics = MetricsWriter(run_dir, cfg.logging.tensorboard, iteration)
        tp_group = ps.get_tensor_model_parallel_group()

        def save(it):
            t0 = time.perf_counter()
            path = save_checkpoint(save_dir, it, ddp_chunks, optimizer, scheduler,
                                   consumed_samples, cfg, par.use_distributed_optimizer)
            _print0(f"saved checkpoint {path} in {time.perf_counter() - t0:.1f}s")
            return it

        # ---- loop ------------------------------------------------------------------------
        last_saved = iteration if ckpt is not None else None
        win_loss, win_n, win_time, win_tokens, win_steps = 0.0, 0, 0.0, 0, 0
        last_val = None
        start_iteration = iteration
        if iteration >= train_iters:
            _print0(f"nothing to do: the checkpoint is at iteration {iteration} >= "
                    f"{train_iters} training iterations")
        while iteration < train_iters:
            scheduler.step(1)  # iteration k runs at scheduler step k
            lr = float(optimizer.param_groups[0]["lr"])
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            with comm.record_collectives(tp_group) as comm_log:
                out = train_step(forward_step, data_iters, ddp_chunks, optimizer,
                                 num_microbatches, seq, mbs, opt_param_scheduler=None)
            if device == "cuda":
                torch.cuda.synchronize()
            step_time = time.perf_counter() - t0
            iteration += 1
            consumed_samples += gbs
            win_time += step_time
            win_tokens += gbs * seq
            win_steps += 1
            if out["loss"] is not None:
                win_loss += out["loss"]
                win_n += 1

            do_log = iteration % cfg.logging.log_interval == 0 or iteration == train_iters
            do_eval = eval_iters > 0 and (
                (t.eval_interval and iteration % t.eval_interval == 0)
                or iteration == train_iters)
            if do_log or do_eval:
                loss = _broadcast_from_last_stage(win_loss / win_n if win_n else None, dev)
                tokens_per_s = win_tokens / win_time if win_time > 0 else 0.0
                tflops = fpt * tokens_per_s / world / 1e12
                record = {
                    "iteration": iteration, "tokens": consumed_samples * seq, "loss": loss,
                    "lr": lr, "grad_norm": out["grad_norm"], "tokens_per_s": tokens_per_s,
                    "tflops": tflops, "mfu": (tflops / peak) if peak else None,
                    "tp_comm_bytes": comm_log.bytes(),
                    "peak_mem_bytes": _peak_memory_bytes(device),
                    "step_time_s": win_time / max(1, win_steps),
                }
                mfu_str = "n/a" if record["mfu"] is None else f"{100 * record['mfu']:.1f}%"
                line = (f"iter {iteration:>6}/{train_iters} | tokens {record['tokens']:>12,} | "
                        f"loss {_fmt(loss, '.4f')} | lr {lr:.3e} | grad_norm "
                        f"{_fmt(out['grad_norm'], '.3f')} | {tokens_per_s:,.0f} tok/s | "
                        f"{tflops:.3g} TFLOP/s/dev | MFU {mfu_str} | "
                        f"tp_comm {_fmt_bytes(record['tp_comm_bytes'])}/step | peak mem "
                        f"{_fmt_bytes(record['peak_mem_bytes'])}")
                if do_eval:
                    t0 = time.perf_counter()
                    val = evaluate()
                    record["val_loss"] = val
                    record["val_ppl"] = math.exp(min(val, 700.0)) if val is not None else None
                    last_val = (iteration, val, record["val_ppl"])
                    line += (f"\n  validation @ {iteration}: val_loss {_fmt(val, '.4f')} | "
                             f"val_ppl {_fmt(record['val_ppl'], '.2f')} "
                             f"({time.perf_counter() - t0:.1f}s)")
                _print0(line)
                metrics.write(record)
                win_loss, win_n, win_time, win_tokens, win_steps = 0.0, 0, 0.0, 0, 0

            if cfg.checkpoint.save_interval and iteration % cfg.checkpoint.save_interval == 0:
                last_saved = save(iteration)
            if iteration < train_iters and _signal_agreed(dev):
                if last_saved != iteration:
                    last_saved = save(iteration)
                name = signal.Signals(_SIGNAL["received"]).name if _SIGNAL["received"] \
                    else "signal on another rank"
                _print0(f"pre-emption signal received, checkpoint saved at iteration "
                        f"{iteration} ({name}; exiting with status {PREEMPT_EXIT_CODE})")
                metrics.close()
                return PREEMPT_EXIT_CODE

        if iteration > start_iteration and last_saved != iteration:
            save(iteration)
        metrics.close()
        wall = time.perf_counter() - t_start
        if last_val is not None:
            _print0(f"done: {iteration} iterations, {consumed_samples * seq:,} tokens in "
                    f"{wall:.1f}s | final validation (iteration {last_val[0]}): "
                    f"val_loss {last_val[1]:.4f}, val_ppl {last_val[2]:.2f}")
        else:
            _print0(f"done: {iteration} iterations, {consumed_samples * seq:,} tokens in "
                    f"{wall:.1f}s")
        return 0
    finally:
        destroy_num_microbatches_calculator()


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="pretrain_lowrank.py",
        description="Pretrain a low-rank bottleneck LLM (CoLA) with megatron-core and BOOST's "
                    "bottleneck-aware tensor parallelism.",
        epilog="Overrides use dotted keys, e.g. parallel.tp=2 training.train_iters=100 "
               "model.attn_rank=64 (values parsed as YAML). Launch several processes with "
               "torchrun --nproc_per_node=N.")
    parser.add_argument("--config", required=True, help="YAML run configuration")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides")
    return parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point: parse, load the config, train. ``ValueError`` → ``error: ...`` + exit 2."""
    args = parse_args(argv)
    try:
        from megatron_boost.config.run import load_run_config

        cfg = load_run_config(args.config, args.overrides)
        return train(cfg)
    except ValueError as err:
        if os.environ.get("MBOOST_TRACEBACK"):
            raise
        msg = " ".join(str(err).split()) or type(err).__name__
        print(f"error: {msg}", file=sys.stderr, flush=True)
        return CONFIG_ERROR_EXIT_CODE
    finally:
        _shutdown()


def _shutdown() -> None:
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
    except Exception:  # pragma: no cover - best effort at exit
        pass
