"""Training-step pieces on megatron-core: parallel state, DDP, optimizer, forward step.

megatron-core ships no training loop. These functions wire its DistributedDataParallel, optimizer
and pipeline schedules together correctly (docs/design.md §10.1, §10.3):
``finalize_model_grads_func`` is always set (without it there is NO data-parallel gradient
all-reduce), ``no_sync_func`` / ``grad_sync_func`` with overlapped reduction, ``grad_scale_func``,
and losses reported as detached clones (the schedules divide the loss in place).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterator, List, Optional

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig as McoreOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_boost.compat import forward_backward_func
from megatron_boost.config.transformer import BoostTransformerConfig
from megatron_boost.model.gpt import build_model, schedule_seq_length
from megatron_boost.model.init import build_globally_initialised
from megatron_boost.train.megatron_fixes import inner_torch_optimizers
from megatron_boost.train.muon import build_muon_optimizer
from megatron_boost.train.resilience import StepAgreement, agree_on_step

__all__ = [
    "initialize_parallel", "on_run_device", "build_ddp_model", "build_optimizer", "make_forward_step",
    "run_schedule", "train_step", "eval_step",
]


def initialize_parallel(tp: int, pp: int, vpp: Optional[int], seed: int,
                        timeout_minutes: float = 30.0, cuda_graphs: bool = False) -> int:
    """Create megatron's process groups (torch.distributed must be initialised) and seed the
    tensor-parallel RNG tracker. Returns the data-parallel size. The world layout is checked
    by ``config.validation.ParallelDims`` (and again by megatron itself). ``timeout_minutes``
    bounds every collective of those groups (megatron's default is 30). ``cuda_graphs``
    (``training.cuda_graph_impl: local``): the tracker keeps its states in graph-safe
    generators, which megatron's graph capture requires of it."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp, distributed_timeout_minutes=timeout_minutes)
    model_parallel_cuda_manual_seed(seed, use_cudagraphable_rng=cuda_graphs)
    return parallel_state.get_data_parallel_world_size()


def on_run_device(chunks: List[torch.nn.Module], config: BoostTransformerConfig,
                  device: str) -> List[torch.nn.Module]:
    """The chunks on the run's device (``ResolvedRun.device``: 'cuda' is this rank's current
    CUDA device, anything else the CPU), and for bf16 in megatron's Float16Module, as the
    trainer runs them: the one device rule of every build (training and inference)."""
    target = (torch.device("cuda", torch.cuda.current_device()) if device == "cuda"
              else torch.device("cpu"))
    chunks = [c.to(target) for c in chunks]
    if config.bf16:
        from megatron.core.transformer.module import Float16Module
        chunks = [Float16Module(config, c) for c in chunks]
    return chunks


def build_ddp_model(config: BoostTransformerConfig, vocab_size: int, seq_length: int,
                    seed: int, *, device: str, overlap_grad_reduce: bool = False,
                    use_distributed_optimizer: bool = False,
                    rotary_base: int = 10000,
                    pg_collection=None) -> List[DistributedDataParallel]:
    """Build this rank's model chunks, initialise them layout-independently from ``seed``
    (each weight drawn once, docs/design.md §8), place them on ``device``
    (:func:`on_run_device`) and wrap each in megatron's DDP (fp32 gradient buffers). Entry
    points call ``train.build.build_run``, which passes the resolved run's values."""
    chunks = build_globally_initialised(
        lambda: build_model(config, vocab_size, seq_length, pg_collection=pg_collection,
                            rotary_base=rotary_base), config, seed)
    chunks = on_run_device(chunks, config, device)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer)
    ddp = [DistributedDataParallel(config, ddp_config, c,
                                   disable_bucketing=(i > 0))
           for i, c in enumerate(chunks)]
    for m in ddp:
        m.broadcast_params()  # DP replicas start identical (init already makes them so)
    # Without this megatron-core issues no data-parallel gradient all-reduce at all.
    config.finalize_model_grads_func = finalize_model_grads
    if overlap_grad_reduce:
        config.no_sync_func = [m.no_sync for m in ddp]
        config.grad_sync_func = [m.start_grad_sync for m in ddp]
        if len(ddp) == 1:
            config.no_sync_func = config.no_sync_func[0]
            config.grad_sync_func = config.grad_sync_func[0]
    return ddp


def build_optimizer(config: BoostTransformerConfig, ddp_chunks, *, lr: float, min_lr: float,
                    weight_decay: float, adam_beta1: float = 0.9, adam_beta2: float = 0.95,
                    adam_eps: float = 1e-8, clip_grad: float = 1.0,
                    use_distributed_optimizer: bool = False, muon=None, tp_group=None):
    """megatron-core's Adam (decoupled weight decay) with global-norm clipping; with ``muon``
    (the run's optimizer section, ``name: muon``) Muon for the 2-D weights and Adam for the
    rest (train/muon.py), clipped together. ``tp_group``: the model's TP group (default
    megatron's)."""
    opt_config = McoreOptimizerConfig(
        optimizer="adam", lr=lr, min_lr=min_lr, weight_decay=weight_decay,
        adam_beta1=adam_beta1, adam_beta2=adam_beta2, adam_eps=adam_eps, clip_grad=clip_grad,
        bf16=config.bf16, params_dtype=config.params_dtype,
        use_distributed_optimizer=use_distributed_optimizer)
    if muon is not None and muon.name == "muon":
        optimizer = build_muon_optimizer(opt_config, ddp_chunks, muon, tp_group)
    else:
        optimizer = get_megatron_optimizer(opt_config, ddp_chunks)
    _fuse_torch_adam(optimizer)
    config.grad_scale_func = optimizer.scale_loss
    return optimizer


def _fuse_torch_adam(optimizer) -> None:
    """Without apex or TE megatron builds torch's AdamW, whose unfused update reads every
    parameter's step counter with ``.item()``: one host read per parameter per step. Its fused
    kernel (CPU and CUDA) keeps the counter on the parameter's device and updates all
    parameters in one launch per device and dtype, with the same arithmetic. torch reads
    ``fused`` from the param groups at every step; a checkpoint's groups bring their own."""
    for opt in inner_torch_optimizers(optimizer):
        if isinstance(opt, torch.optim.Adam):  # AdamW derives from Adam
            opt.defaults.update(fused=True, foreach=False)
            for group in opt.param_groups:
                group.update(fused=True, foreach=False)


def _loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Mean token loss of one micro-batch. The schedules divide the returned loss in place by
    the number of micro-batches, so the reported value is a detached clone."""
    losses = output_tensor.float()  # [b, s]
    mask = loss_mask.float()
    loss = (losses * mask).sum() / mask.sum().clamp_min(1.0)
    return loss, {"lm loss": loss.detach().clone()}


def make_forward_step(get_batch: Callable[[Iterator], dict]):
    """A megatron forward_step_func; ``get_batch(iterator)`` returns tokens, labels,
    loss_mask, position_ids ([b, s] tensors)."""

    def forward_step(data_iterator, model):
        batch = get_batch(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        return output, partial(_loss_func, batch["loss_mask"])

    return forward_step


def run_schedule(forward_step, data_iterators, ddp_chunks, num_microbatches: int,
                 seq_length: int, micro_batch_size: int, forward_only: bool):
    """megatron's forward-backward function over this rank's chunks (one iterator per
    chunk); returns the loss dicts of the micro-batches (empty off the last stage)."""
    config = ddp_chunks[0].config
    iters = data_iterators if len(ddp_chunks) > 1 else data_iterators[0]
    return forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iters, model=ddp_chunks,
        num_microbatches=num_microbatches,
        seq_length=schedule_seq_length(config, seq_length),
        micro_batch_size=micro_batch_size, forward_only=forward_only)


_run_schedule = run_schedule  # this module's callers


def _grad_buffers(ddp_chunks) -> list:
    return [buffer.grad_data for chunk in ddp_chunks
            for buffer in chunk.buffers + chunk.expert_parallel_buffers]


def _agree(losses, ddp_chunks, check_grads: bool, preempt_requested: bool,
           time_up: bool = False) -> StepAgreement:
    """The step's one all-reduce and host read (``agree_on_step``): finiteness, pre-emption,
    the time limit and the mean loss over the global batch, reported by one rank per data-parallel replica."""
    reporter = (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
                and parallel_state.get_tensor_model_parallel_rank() == 0
                and parallel_state.get_context_parallel_rank() == 0)
    device = next(ddp_chunks[0].parameters()).device
    return agree_on_step([l["lm loss"] for l in losses],
                         _grad_buffers(ddp_chunks) if check_grads else [], preempt_requested,
                         reporter, device, time_up)


def train_step(forward_step, data_iterators, ddp_chunks, optimizer, num_microbatches: int,
               seq_length: int, micro_batch_size: int, preempt_requested: bool = False,
               time_up: bool = False) -> dict:
    """One optimizer step over ``num_microbatches`` micro-batches per DP rank.

    Returns loss (mean over the global batch, on every rank), grad_norm, skipped, preempt and
    time_up.
    Between the backward pass and the optimizer step ONE all-reduce over the world
    (:func:`~megatron_boost.train.resilience.agree_on_step`) carries every rank's
    non-finite flag (losses and gradient buffers), its pre-emption flag
    (``preempt_requested``) and the loss, read once on the host: a step any rank flags as
    non-finite is skipped by every rank (parameters and optimizer state stay untouched), and
    ``preempt`` (``time_up``) is True on every rank when any rank received a pre-emption
    signal (passed ``training.exit_duration_minutes``: the caller's ``time_up``). Besides it,
    the optimizer's gradient norm is the step's only host read. The caller steps the
    learning-rate scheduler (before the step: iteration k runs at scheduler step k)."""
    for m in ddp_chunks:
        m.zero_grad_buffer()
    optimizer.zero_grad()
    losses = _run_schedule(forward_step, data_iterators, ddp_chunks, num_microbatches,
                           seq_length, micro_batch_size, forward_only=False)
    agreed = _agree(losses, ddp_chunks, check_grads=True, preempt_requested=preempt_requested,
                    time_up=time_up)
    out = {"loss": agreed.loss, "preempt": agreed.preempt, "time_up": agreed.time_up,
           "skipped": not agreed.finite,
           "grad_norm": None}
    if agreed.finite:
        _, grad_norm, _ = optimizer.step()
        out["grad_norm"] = None if grad_norm is None else float(grad_norm)
    return out


def eval_step(forward_step, data_iterators, ddp_chunks, num_microbatches: int,
              seq_length: int, micro_batch_size: int) -> Optional[float]:
    """Forward-only pass; mean loss over the global batch, on every rank."""
    for m in ddp_chunks:
        m.eval()
    try:
        with torch.no_grad():
            losses = _run_schedule(forward_step, data_iterators, ddp_chunks, num_microbatches,
                                   seq_length, micro_batch_size, forward_only=True)
    finally:
        for m in ddp_chunks:
            m.train()
    return _agree(losses, ddp_chunks, check_grads=False, preempt_requested=False).loss
